"""Releasing and resuming GPU memory with torch-memory-saver, on the GPU.
Each job runs in a fresh process: the device-wide numbers then belong to
that engine alone, and the library's per-process state starts clean."""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

COMMON = textwrap.dedent("""
    import faulthandler, sys
    faulthandler.dump_traceback_later(int(sys.argv[1]), exit=True)  # a hang shows where, then fails the job
    import gc, json, torch
    from rollout_engine import RolloutEngine, SamplingParams
    GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    PROMPTS = [list(range(1000 + 37 * i, 1000 + 37 * i + 100 + 20 * i)) for i in range(8)]
    def used():
        free, total = torch.cuda.mem_get_info()
        return total - free
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    def tokens(engine):
        return [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    def result(**kw):
        print("RESULT " + json.dumps(kw), flush=True)
    def fifty_cycles(engine, reference, mark):
        # release and resume 50 times: (marks at cycles 2 and 49, the first cycle whose outputs changed or None)
        marks, first_change = [], None
        for cycle in range(50):
            engine.release_memory()
            engine.resume_memory()
            if tokens(engine) != reference and first_change is None:
                first_change = cycle
            if cycle in (2, 49):
                gc.collect()
                marks.append(mark())
        return marks, first_change
""")
# Under a main guard: a tp_size=2 engine spawns its worker, which imports this
# script again (as multiprocessing's spawn does) and must not run the job.
MAIN = textwrap.dedent("""
    torch.zeros(1, device="cuda")  # the CUDA context is not the engine's
    used0 = used()
""")


def _job(body: str, tmp_path, preload: bool = False, limit: int = 840, env: dict | None = None) -> dict:
    pytest.importorskip("torch_memory_saver")
    script = tmp_path / "job.py"
    script.write_text(COMMON + 'if __name__ == "__main__":\n'
                      + textwrap.indent(MAIN + textwrap.dedent(body), "    "))
    cmd = [sys.executable, str(script), str(limit)]
    if preload:
        cmd = [sys.executable, "-m", "rollout_engine.cli", "run", "--"] + cmd
    # Output to files, not pipes: a TP worker outliving its rank 0 (which the faulthandler ends at `limit`)
    # would hold a pipe open and block the test. Whatever of the job's process group is left after it shows
    # its stack (SIGABRT under PYTHONFAULTHANDLER) and is ended.
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    # The job measures the GPU as a fresh process: engines earlier tests left to the collector (and the blocks
    # this process's allocator caches) would otherwise hold memory it counts on.
    gc.collect()
    torch.cuda.empty_cache()
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
        try:
            proc.wait(timeout=limit + 60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGABRT)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left: the usual case
            pass
        proc.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, (proc.returncode, stdout[-3000:], stderr[-6000:])
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    print(result)
    return result


def test_release_after_a_7b_rollout_frees_nearly_all_and_a_trainer_can_use_it(tmp_path):
    r = _job("""
        engine = RolloutEngine("qwen2.5-7b", load_format="dummy", enable_memory_saver=True,
                               weights_cpu_backup=True, cuda_graph_max_batch_size=32)
        before = tokens(engine)
        held = used() - used0
        reported = engine.release_memory()
        freed = held - (used() - used0)
        # The trainer's turn: it takes 90% of what the engine gave back, then frees it.
        block = torch.empty(int(0.9 * freed), dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        trainer = block.numel()
        del block
        torch.cuda.empty_cache()
        engine.resume_memory()
        result(held=held, freed=freed, reported=reported, trainer=trainer, same=tokens(engine) == before)
        engine.check_integrity()
    """, tmp_path)
    assert r["freed"] >= 0.95 * r["held"]
    assert r["trainer"] >= 0.9 * r["freed"] * 0.999
    assert r["same"]
    assert abs(sum(r["reported"].values()) - r["freed"]) <= 0.02 * r["held"]


def test_fifty_cycles_do_not_grow_memory_and_keep_outputs(tmp_path):
    r = _job("""
        engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True,
                               weights_cpu_backup=True, max_total_tokens=131072, cuda_graph_max_batch_size=16)
        marks, first_change = fifty_cycles(engine, tokens(engine), lambda: (used(), rss()))
        result(marks=marks, same=first_change is None, first_change=first_change)
    """, tmp_path)
    (gpu_a, rss_a), (gpu_b, rss_b) = r["marks"]
    assert r["same"]
    assert gpu_b - gpu_a <= 64 << 20
    assert rss_b - rss_a <= 256 << 20


@pytest.mark.multigpu
@pytest.mark.parametrize("allreduce", ["", "one-shot", "nccl"], ids=["unset", "one-shot", "nccl"])
def test_tp2_fifty_cycles_release_both_gpus_without_growth(tmp_path, allreduce):
    """A standalone TP=2 engine (rank 1 in its own process on GPU 1): each
    release frees most of what the engine holds on both GPUs, and fifty
    cycles neither grow memory on either GPU nor change the outputs. With
    the default (the norms take the all-reduce, in one kernel, its buffers
    outside what a release frees), with the one-shot all-reduce for small
    messages and with NCCL alone; the
    result also says whether outputs hold between two calls without a
    release in between (`stable`) and at which cycle they first changed.
    Every call computes its prompts afresh (a release drops the cache): with
    random weights the top two logits are often exactly tied in bf16, and a
    cache hit, which changes the prefill's shape, may pick the other one (it
    does at TP=1 too); tests/test_gpu_deterministic.py checks cache hits
    under TP bit for bit."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    r = _job("""
        def used_on(d):
            free, total = torch.cuda.mem_get_info(d)
            return total - free
        torch.zeros(1, device="cuda:1")  # this process's context on GPU 1 is not the engine's either
        base = [used_on(0), used_on(1)]
        engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True, tp_size=2,
                               weights_cpu_backup=True, max_total_tokens=131072, cuda_graph_max_batch_size=16)
        reference = tokens(engine)
        engine.flush_cache()
        stable = tokens(engine) == reference  # no release in between
        engine.flush_cache()
        held = [used_on(0) - base[0], used_on(1) - base[1]]
        reported = sum(engine.release_memory().values())  # rank 0's; rank 1 holds the same shapes
        freed = [held[0] + base[0] - used_on(0), held[1] + base[1] - used_on(1)]
        engine.resume_memory()
        marks, first_change = fifty_cycles(engine, reference, lambda: [used_on(0), used_on(1)])
        engine.shutdown()
        result(held=held, reported=reported, freed=freed, marks=marks, same=first_change is None, stable=stable,
               first_change=first_change)
    """, tmp_path, limit=180, env={"ROLLOUT_ENGINE_ALLREDUCE": allreduce})
    assert r["stable"] and r["same"], r
    # What stays is not the engine's to release: NCCL's buffers, loaded kernels, and on GPU 1 rank 1's CUDA context.
    assert r["reported"] >= 0.8 * r["held"][0], r
    for gpu in (0, 1):
        assert r["freed"][gpu] >= 0.97 * r["reported"], (gpu, r)  # what rank 0 reports leaves both GPUs
        assert r["marks"][1][gpu] - r["marks"][0][gpu] <= 64 << 20, (gpu, r)


def test_preload_hook_pauses_the_graph_pool(tmp_path):
    r = _job("""
        engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True,
                               weights_cpu_backup=True, max_total_tokens=65536, cuda_graph_max_batch_size=16)
        before = tokens(engine)
        u0 = used()
        freed = engine.release_memory(["cuda_graph"])
        device_freed = u0 - used()
        engine.resume_memory(["cuda_graph"])
        engine.release_memory()
        engine.resume_memory()
        result(mode=engine.core.parts.controller.graph_mode, graph_bytes=freed["cuda_graph"], device_freed=device_freed,
               same=tokens(engine) == before)
    """, tmp_path, preload=True)
    assert r["mode"] == "pause" and r["same"]
    assert r["graph_bytes"] > 0 and r["device_freed"] >= 0.9 * r["graph_bytes"]
