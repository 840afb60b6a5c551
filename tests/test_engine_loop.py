"""The engine's one step loop: many front ends at once, an idle loop that
uses no CPU, and callers that leave early (a timeout, a closed stream, a
SIGINT) taking their requests with them."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

JOIN_S = 120


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny model with peaked logits (large weights): greedy tokens do not
    flip on the rounding differences between batch shapes."""
    return save_model(make_hf_model("llama", seed=3, initializer_range=0.2, max_position_embeddings=8192), tmp_path_factory.mktemp("peaked"))


@pytest.fixture(scope="module")
def engine(peaked):
    e = RolloutEngine(peaked, device="cpu", max_total_tokens=16384)
    yield e
    e.shutdown()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _kv_all_back(engine) -> bool:
    m = engine.metrics()
    return m["kv_free_tokens"] + m["cache"]["cached_tokens"] == m["kv_capacity_tokens"]


def _wait_until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_threads_tasks_and_streams_at_once_equal_each_request_alone(engine):
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 9)] for i in range(40)]
    lengths = [4 + (i * 7) % 37 for i in range(40)]
    alone = [engine.generate(input_ids=[p], sampling_params=_greedy(n))[0].output_token_ids
             for p, n in zip(prompts, lengths)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    @guarded
    def blocking(i: int) -> None:
        got[i] = engine.generate(input_ids=[prompts[i]], sampling_params=_greedy(lengths[i]))[0].output_token_ids

    @guarded
    def streaming(i: int) -> None:
        tokens = []
        for delta in engine.stream(input_ids=[prompts[i]], sampling_params=_greedy(lengths[i])):
            tokens += delta.output_token_ids
        got[i] = tokens

    @guarded
    def tasks() -> None:
        async def one(i: int) -> None:
            outs = await engine.generate_async(input_ids=[prompts[i]], sampling_params=_greedy(lengths[i]))
            got[i] = outs[0].output_token_ids

        async def all_tasks() -> None:
            await asyncio.gather(*(one(i) for i in range(16, 32)))

        asyncio.run(all_tasks())

    threads = [threading.Thread(target=blocking, args=(i,)) for i in range(16)]
    threads += [threading.Thread(target=tasks)]
    threads += [threading.Thread(target=streaming, args=(i,)) for i in range(32, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [got[i] for i in range(40)] == alone
    engine.check_integrity()
    assert engine.num_unfinished_requests() == 0


def test_an_idle_engine_uses_no_cpu(engine):
    engine.generate(input_ids=[[1, 2, 3]], sampling_params=_greedy(4))  # the loop has run
    cpu = time.process_time()
    time.sleep(5)
    assert time.process_time() - cpu < 0.05  # < 1% of a core over 5 s


def test_a_timed_out_generate_async_aborts_its_requests(engine):
    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.generate_async(input_ids=[[1, 2, 3], [4, 5]],
                                                         sampling_params=_greedy(5000)), 0.5)

    asyncio.run(main())
    assert _wait_until(lambda: engine.num_unfinished_requests() == 0, 1.0)
    assert _wait_until(lambda: _kv_all_back(engine), 1.0)
    engine.check_integrity()


def test_a_stream_closed_after_three_deltas_aborts_its_requests(engine):
    it = engine.stream(input_ids=[[9, 8, 7]], sampling_params=SamplingParams(max_new_tokens=5000, temperature=0,
                                                                             ignore_eos=True, n=2))
    for _ in range(3):
        next(it)
    assert engine.num_unfinished_requests() == 2
    it.close()
    assert _wait_until(lambda: engine.num_unfinished_requests() == 0, 1.0)
    assert _wait_until(lambda: _kv_all_back(engine), 1.0)
    engine.check_integrity()


def test_leaving_stream_async_aborts_its_requests(engine):
    async def main() -> int:
        seen = 0
        stream = engine.stream_async(input_ids=[[5, 6]], sampling_params=_greedy(5000))
        async for delta in stream:
            seen += len(delta.output_token_ids)
            if seen >= 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(main()) >= 3
    assert _wait_until(lambda: engine.num_unfinished_requests() == 0, 1.0)
    engine.check_integrity()


def _signal_lines(status: str) -> str:
    """The signal masks of a /proc status file, to tell why a signal did nothing."""
    return "".join(line + "\n" for line in status.splitlines() if line.startswith("Sig") or line.startswith("Shd"))


def test_sigint_ends_a_program_awaiting_generate_async(peaked):
    script = textwrap.dedent(f"""
        import asyncio, faulthandler, signal, sys
        from rollout_engine import RolloutEngine, SamplingParams
        faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it hangs
        # As run from a terminal: a suite started as a background job passes SIGINT on ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        async def main():
            engine = RolloutEngine({str(peaked)!r}, device="cpu", max_total_tokens=16384)
            task = asyncio.ensure_future(engine.generate_async(
                input_ids=[[1, 2, 3]] * 4, sampling_params=SamplingParams(max_new_tokens=8000, ignore_eos=True)))
            while engine.metrics()["output_tokens"] < 8:
                await asyncio.sleep(0.01)
            print("generating", flush=True)
            await task

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "generating", proc.stderr.read()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=8)  # the whole rollout takes minutes; slack for a loaded machine
        except subprocess.TimeoutExpired:
            status = open(f"/proc/{proc.pid}/status").read()
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            raise AssertionError("no exit 8 s after SIGINT\n" + _signal_lines(status) + proc.stderr.read()) from None
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert took < 8
    assert proc.returncode in (130, 1), stderr
    assert len(stderr.strip().splitlines()) < 5, stderr


def test_the_progress_bar_counts_tokens_while_a_batch_runs(engine, capsys, monkeypatch):
    """Requests of one batch finish together, so a bar of finished requests
    alone would sit at 0/4 until the end: it also shows the tokens made."""
    import re

    from rollout_engine import progress
    from rollout_engine.core import calls

    monkeypatch.setattr(calls, "PROGRESS_TICK_SECONDS", 0.001)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # stderr is captured (a log): a line at every update
    params = SamplingParams(n=4, max_new_tokens=200, temperature=1.0, seed=1, ignore_eos=True)
    outs = engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, progress=True)
    err = capsys.readouterr().err
    counts = [int(t) for t in re.findall(r"tokens=(\d+)", err)]
    assert "4/4" in err and counts and counts[-1] == sum(len(o.output_token_ids) for o in outs) == 800, err[-500:]
    assert any(0 < c < 800 for c in counts), counts  # seen while the batch ran
    assert "\r" not in err and len(err.splitlines()) == 1 + len(counts)  # the start, then a line per redraw


def test_the_progress_bar_in_a_log_writes_lines_not_redraws(engine, capsys, monkeypatch):
    """stderr redirected (a batch job's log): no carriage returns, and no
    line more often than every LOG_EVERY_S (30 s), however often the bar
    updates: the first line says it started, the last how it ended."""
    from rollout_engine.core import calls

    monkeypatch.setattr(calls, "PROGRESS_TICK_SECONDS", 0.001)
    params = SamplingParams(n=8, max_new_tokens=100, temperature=1.0, seed=1, ignore_eos=True)
    engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=params, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and not any("\r" in line for line in lines), lines
    assert lines[0].startswith("rollout:   0%") and "0/16" in lines[0], lines
    assert lines[1].startswith("rollout: 100%") and "16/16" in lines[1] and "tokens=1600" in lines[1], lines


def test_the_awaitable_generate_shows_the_bar_too(engine, capsys):
    import asyncio

    params = SamplingParams(n=8, max_new_tokens=50, temperature=1.0, seed=1, ignore_eos=True)
    outs = asyncio.run(engine.generate_async(input_ids=[[1, 2, 3], [4, 5]], sampling_params=params, progress=True))
    lines = capsys.readouterr().err.splitlines()
    assert len(outs) == 16 and lines[0].startswith("rollout:   0%") and "0/16" in lines[0], lines
    assert lines[-1].startswith("rollout: 100%") and "16/16" in lines[-1] and "tokens=800" in lines[-1], lines


def test_the_progress_bar_of_an_aborted_call_stops_where_it_was(engine, capsys, monkeypatch):
    """Requests stopped by an abort (Ctrl-C, engine.abort()) are not counted
    as done: the bar's last line says how far the call got, not 100%."""
    import threading

    from rollout_engine import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    quick = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    endless = SamplingParams(n=3, max_new_tokens=8000, temperature=1.0, seed=1, ignore_eos=True)
    timer = threading.Timer(0.5, engine.abort)
    timer.start()
    try:
        outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=[quick, endless], progress=True)
    finally:
        timer.cancel()
    assert [o.finish_reason for o in outs] == ["length"] + ["abort"] * 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1/4" in last and "100%" not in last, last
    assert f"tokens={sum(len(o.output_token_ids) for o in outs)}" in last, last  # every token, the aborted ones too


def test_the_progress_bar_on_a_terminal_redraws_in_place(engine, monkeypatch):
    """On a terminal: tqdm's live bar, redrawn in place."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    params = SamplingParams(n=2, max_new_tokens=50, temperature=1.0, seed=1, ignore_eos=True)
    engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, progress=True)
    out = term.getvalue()
    assert out.count("\r") >= 2 and "2/2" in out, out


def test_ctrl_c_while_the_engine_builds_exits_cleanly(peaked, tmp_path):
    """Ctrl-C while the loop thread is still building (inside torch): the
    constructor raises KeyboardInterrupt, and at exit the interpreter waits
    for the build to end instead of killing the thread inside torch (which
    aborted the process: "terminate called without an active exception")."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        import torch
        import rollout_engine.core.engine_core as engine_core
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def slow_build(self, cfg):  # Ctrl-C, then seconds of torch work on the loop thread, then a failure
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            a = torch.randn(1024, 1024)
            end = time.monotonic() + 3
            while time.monotonic() < end:
                a = torch.tanh(a @ a)
            open({str(tmp_path / "build-ended")!r}, "w").close()
            raise RuntimeError("not built")

        engine_core.EngineCore._build = slow_build
        engine_core.STOP_AT_EXIT_SECONDS = 0.5  # shorter than the build: only the wait for builds covers it
        from rollout_engine import RolloutEngine
        try:
            RolloutEngine({str(peaked)!r}, device="cpu")
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "interrupted" in proc.stderr and "terminate called" not in proc.stderr
    assert (tmp_path / "build-ended").exists()  # the process waited for the build to end


def test_the_next_engine_frees_what_a_dropped_one_held(peaked):
    """An engine dropped without shutdown() and kept only by cycles: its
    finalizer asks its loop to stop without waiting, and its parts (model,
    KV cache) go only once the loop has ended and the collector has run
    again. Building the next engine sees to both before it sizes its KV
    cache (core/live.py)."""
    import gc
    import weakref

    from rollout_engine.core.live import release_dropped_engines

    dropped = RolloutEngine(peaked, device="cpu", max_total_tokens=1024)
    core, kv = weakref.ref(dropped.core), weakref.ref(dropped.core.parts.kv_pool)
    dropped.cycle = dropped  # only the collector frees it
    gc.disable()  # nothing collects it meanwhile by chance
    try:
        del dropped
        assert core() is not None
        release_dropped_engines(wait_s=JOIN_S)
        assert core() is None and kv() is None
    finally:
        gc.enable()
