"""Standalone tensor-parallel engines in one process, one after another."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_a_second_tp_engine_beside_a_live_one_is_refused_and_after_shutdown_builds(tiny_models, tmp_path):
    """A standalone TP engine's ranks form torch.distributed's default group
    in the process that built it. A second engine with tp_size > 1 took that
    group for a job to embed in and waited forever for its other ranks (Ctrl-C
    could not stop it). It is now refused at once, and after the first one's
    shutdown the next builds and gives the same tokens. In a subprocess with
    a deadline, so that a hang fails the test."""
    folder = tiny_models[("llama", False)][1]
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(f"""
        from rollout_engine import RolloutEngine, SamplingParams

        if __name__ == "__main__":
            params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            first = RolloutEngine({folder!r}, device="cpu", tp_size=2, max_total_tokens=1024)
            before = first.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].output_token_ids
            try:
                RolloutEngine({folder!r}, device="cpu", tp_size=2, max_total_tokens=1024)
                print("SECOND BUILT")
            except RuntimeError as e:
                print("REFUSED:", e)
            print("FIRST STILL:", first.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].output_token_ids
                  == before)
            first.shutdown()
            again = RolloutEngine({folder!r}, device="cpu", tp_size=2, max_total_tokens=1024)
            print("AGAIN:", again.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].output_token_ids
                  == before)
            again.shutdown()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("REFUSED: a tensor-parallel engine is already running in this process")
               for line in lines), proc.stdout
    assert "FIRST STILL: True" in lines and "AGAIN: True" in lines, proc.stdout
