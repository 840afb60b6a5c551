"""`rollout-engine` and Ctrl-C: one line and status 130 wherever it lands
(the imports, the rollout, the engine's shutdown, the interpreter's
teardown), the samples so far kept where there is time for them."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from rollout_engine.cli import main


@pytest.fixture(autouse=True)
def _ctrl_c_delivered():
    """Each test starts with Python's own Ctrl-C handler. Started with Ctrl-C
    ignored (a script's background job: `python -m pytest &`), the suite would
    keep ignoring it, as the command does by design, and so would every
    command it starts; a handler set from Python is not passed on to them."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_the_command_imports_is_one_line(monkeypatch, capsys):
    """The console entry point catches Ctrl-C while torch and the command's
    modules import; `import rollout_engine` alone does not import torch."""
    import builtins

    from rollout_engine import console

    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "rollout_engine.cli":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert console.main() == 130
    finally:
        signal.signal(signal.SIGINT, handler)
    assert capsys.readouterr().err.strip() == "rollout-engine: error: interrupted"
    monkeypatch.undo()
    code = "import sys, rollout_engine; print('torch' in sys.modules); rollout_engine.SamplingParams"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_ctrl_c_during_the_heavy_imports_lets_them_finish(monkeypatch, capsys):
    """Ctrl-C while a command's heavy imports run only sets a flag: the
    import under way completes (no half-initialised module), the next is not
    started, and the command ends with one line and 130 before it runs."""
    import builtins

    from rollout_engine import console

    real, seen = builtins.__import__, []

    def import_with_a_ctrl_c(name, *args, **kwargs):
        if name == "torch" and not seen:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of `import torch`
            seen.append(name)
            module = real(name, *args, **kwargs)
            seen.append("torch imported whole")
            return module
        if name == "rollout_engine.engine":
            seen.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_with_a_ctrl_c)
    monkeypatch.setattr(sys, "argv", ["rollout-engine", "generate", "--prompt", "hi"])
    monkeypatch.setattr("rollout_engine.cli.main", lambda *a: pytest.fail("the command ran after Ctrl-C"))
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert console.main() == 130
        assert signal.getsignal(signal.SIGINT) is console._quiet_exit  # a Ctrl-C at shutdown exits quietly
    finally:
        signal.signal(signal.SIGINT, handler)
    assert seen == ["torch", "torch imported whole"]  # finished, and the engine's import not started
    assert capsys.readouterr().err.strip() == console.INTERRUPTED


def test_ctrl_c_during_generate_prints_the_samples_so_far(llama, capsys):
    """Ctrl-C while the model generates aborts the requests: the samples so
    far are printed (finish=abort, the tokens they have), then the one line
    and status 130."""
    import _thread
    import threading

    from rollout_engine.engine import RolloutEngine

    started = threading.Event()
    real = RolloutEngine.generate

    def generate(self, *args, **kwargs):  # Ctrl-C once the run is under way
        threading.Timer(1.0, _thread.interrupt_main).start()
        started.set()
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(RolloutEngine, "generate", generate)
        status = main(["generate", "--model", llama[1], "--device", "cpu", "--input-ids", "[[5,6,7],[8,9]]",
                       "-n", "64", "--max-new-tokens", "500", "--ignore-eos"])
    assert started.is_set() and status == 130
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == "rollout-engine: error: interrupted"
    assert "Traceback" not in captured.err
    assert "128 samples" in captured.out and captured.out.count("--- [") == 128
    # Samples done before the Ctrl-C (a fast machine finishes a few) print whole, the others as far as they got.
    lines = [ln for ln in captured.out.splitlines() if ", finish=" in ln]
    assert len(lines) == 128 and any("finish=abort" in ln for ln in lines)
    assert all(("finish=abort" in ln) != ln.lstrip().startswith("500 tokens, finish=length") for ln in lines), lines


def test_a_ctrl_c_during_the_engines_shutdown_lets_it_finish(llama, capsys):
    """A Ctrl-C after the samples, while the engine shuts down: noted, the
    shutdown runs to its end (raised inside, it cut it short or landed in a
    library's cleanup as 'Exception ignored ... KeyboardInterrupt'), then the
    one line and 130."""
    import os

    from rollout_engine.engine import RolloutEngine

    real, calls = RolloutEngine.shutdown, []

    def shutdown(self):
        if not calls:  # once: the engine may be shut down again later
            calls.append("sent")
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10_000))  # bytecode runs: a raising handler raises here
        real(self)
        calls.append("done")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(RolloutEngine, "shutdown", shutdown)
        status = main(["generate", "--model", llama[1], "--device", "cpu", "--input-ids", "[[5,6,7]]",
                       "--max-new-tokens", "2"])
    assert calls[:2] == ["sent", "done"] and status == 130
    captured = capsys.readouterr()
    assert captured.out.count("--- [") == 1, captured.out
    assert captured.err.strip().splitlines()[-1] == "rollout-engine: error: interrupted"
    assert "Traceback" not in captured.err and "Exception ignored" not in captured.err


def test_the_console_script_skips_the_teardown_only_after_an_interrupt(monkeypatch, capsys):
    """Status 130: streams flushed, then os._exit (no interpreter teardown,
    where a second Ctrl-C would end the process by the signal); any other
    status: a normal exit."""
    from rollout_engine import console

    exits = []
    monkeypatch.setattr(console.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setattr(console, "main", lambda: print("samples so far") or 130)
    with pytest.raises(SystemExit):  # the patched os._exit returns; entry goes on to sys.exit
        console.entry()
    assert exits == [130] and capsys.readouterr().out == "samples so far\n"
    monkeypatch.setattr(console, "main", lambda: 0)
    with pytest.raises(SystemExit) as exit_:
        console.entry()
    assert exit_.value.code == 0 and exits == [130]


@pytest.mark.slow
def test_a_ctrl_c_after_the_interrupted_line_keeps_status_130_and_the_samples(llama):
    """One Ctrl-C: the samples so far (stdout, flushed), the one line, 130.
    The process then skips the interpreter's teardown, so a second Ctrl-C
    right after the line finds it gone instead of killing it by the signal
    mid-teardown (status -2 to a Python parent)."""
    import threading
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rollout_engine.console", "generate", "--model", llama[1],
                             "--device", "cpu", "--input-ids", "[[5,6,7]]", "-n", "16", "--max-new-tokens", "500",
                             "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err, out = [], []

    def read_err():
        while line := proc.stderr.readline():
            err.append(line.decode(errors="replace"))

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    drain = threading.Thread(target=lambda: out.append(proc.stdout.read().decode()), daemon=True)
    drain.start()
    deadline = time.monotonic() + 120
    while not any("rollout:" in line for line in err) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # the rollout's progress bar is up
    time.sleep(1.0)  # generating (500 tokens a sample take several seconds here)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    while not any("error: interrupted" in line for line in err) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # where torch's teardown used to run for a second more
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)  # stderr is the reader's alone
    reader.join(10)
    drain.join(10)
    assert proc.returncode == 130, "".join(err)
    assert out[0].count("--- [") == 16 and "finish=abort" in out[0], out[0][-2000:]


def test_two_quick_ctrl_cs_during_generate_end_in_one_line(llama):
    """A second Ctrl-C right after the first gives up on the samples but
    still ends with the one line and status 130: after the first, Ctrl-C
    only sets a flag, so no KeyboardInterrupt lands in a library's cleanup
    (which printed 'Exception ignored ... Traceback')."""
    import threading
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rollout_engine.console", "generate", "--model", llama[1],
                             "--device", "cpu", "--input-ids", "[[5,6,7]]", "-n", "64", "--max-new-tokens", "500",
                             "--ignore-eos"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    chunks = []

    def read_err():
        while chunk := proc.stderr.read1(4096):
            chunks.append(chunk)

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while b"rollout:" not in b"".join(chunks) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # the rollout's progress bar is up
    time.sleep(1.0)  # generating (500 tokens a sample take tens of seconds here)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # past SAME_PRESS_S: a second press, not the first delivered again
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)  # stderr is the reader's alone (communicate() would take some of its last chunks)
    reader.join(10)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert text.strip().splitlines()[-1] == "rollout-engine: error: interrupted"


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it(monkeypatch):
    """A script's background job starts with SIGINT ignored: the command
    neither catches it during startup nor installs a handler afterwards."""
    from rollout_engine import console

    monkeypatch.setattr(sys, "argv", ["rollout-engine", "--version"])
    monkeypatch.setattr("rollout_engine.cli.main", lambda *a: 0)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert console.main() == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, handler)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid`."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == pid:
            found.append((int(entry), cmdline))
    return found


def _sigint_disposition(pid: int) -> str:
    """'ignored', 'caught' (a handler: Python's KeyboardInterrupt) or
    'default', from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as f:
        masks = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigIgn", "SigCgt")}
    bit = 1 << (signal.SIGINT - 1)
    return "ignored" if masks["SigIgn"] & bit else "caught" if masks["SigCgt"] & bit else "default"


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_tp_workers_import_is_one_line_from_one_process(llama):
    """Ctrl-C from a terminal reaches the whole process group. While a
    `--tp 2` worker is still importing torch (before its own code runs), it
    printed a KeyboardInterrupt traceback of its own; now the worker starts
    deaf to it (checked in /proc as soon as it exists), and the command ends
    with the one line and 130, no worker left."""
    import os
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rollout_engine.console", "generate", "--model", llama[1],
                             "--device", "cpu", "--tp", "2", "--input-ids", "[[5,6,7]]", "--max-new-tokens", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        workers = []
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = [pid for pid, cmd in _children(proc.pid) if "spawn_main" in cmd and "resource_tracker" not in cmd]
            time.sleep(0.01)
        assert workers, "no worker started"
        # Just started (its imports take seconds): it ignores SIGINT already, and never caught it.
        assert [_sigint_disposition(pid) for pid in workers] == ["ignored"] * len(workers)
        time.sleep(0.3)  # the worker is importing torch
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.strip().splitlines()[-1] == "rollout-engine: error: interrupted", text
    time.sleep(0.5)
    assert not [pid for pid in workers if _running(pid)], "a worker is left"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False



def test_the_same_ctrl_c_delivered_again_at_once_is_not_a_second_press(monkeypatch):
    """`timeout -s INT` signals the command and then its whole group, so one
    Ctrl-C can arrive twice: the handler that counts the second press (which
    gives up on the samples so far) lets a signal within SAME_PRESS_S pass."""
    import time

    from rollout_engine import interrupts

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    again = interrupts.DeferredInterrupt(ignore_s=interrupts.SAME_PRESS_S)
    clock[0] += interrupts.SAME_PRESS_S / 2
    again(signal.SIGINT, None)
    assert not again.hit  # the first Ctrl-C, delivered again
    clock[0] += interrupts.SAME_PRESS_S
    again(signal.SIGINT, None)
    assert again.hit  # a second press
    plain = interrupts.DeferredInterrupt()
    plain(signal.SIGINT, None)
    assert plain.hit
