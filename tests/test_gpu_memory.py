"""Releasing and resuming GPU memory with torch-memory-saver, on the GPU."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
PROMPTS = [list(range(1000 + 37 * i, 1000 + 37 * i + 100 + 20 * i)) for i in range(8)]


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _tokens(engine, prompts=PROMPTS, params=GREEDY):
    return [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]


def _baseline() -> int:
    torch.zeros(1, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    return _used()


@pytest.fixture(autouse=True)
def _collect_engines():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def test_release_after_a_7b_rollout_frees_nearly_all_and_a_trainer_can_use_it():
    pytest.importorskip("torch_memory_saver")
    used0 = _baseline()
    engine = RolloutEngine("qwen2.5-7b", load_format="dummy", enable_memory_saver=True, weights_cpu_backup=True,
                           cuda_graph_max_batch_size=32)
    before = _tokens(engine)
    held = _used() - used0
    engine.release_memory()
    freed = held - (_used() - used0)
    print(f"engine held {held / 2**30:.2f} GiB, release freed {freed / 2**30:.2f} GiB ({freed / held:.1%})")
    assert freed >= 0.95 * held
    # The trainer's turn: it takes 90% of what the engine gave back, then frees it.
    block = torch.empty(int(0.9 * freed), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    del block
    torch.cuda.empty_cache()
    engine.resume_memory()
    assert _tokens(engine) == before
    engine.check_integrity()


def test_fifty_cycles_do_not_grow_memory_and_keep_outputs():
    pytest.importorskip("torch_memory_saver")
    engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True, weights_cpu_backup=True,
                           max_total_tokens=131072, cuda_graph_max_batch_size=16)
    reference = _tokens(engine)
    marks = []
    for cycle in range(50):
        engine.release_memory()
        engine.resume_memory()
        assert _tokens(engine) == reference, f"cycle {cycle}"
        if cycle in (2, 49):
            gc.collect()
            marks.append((_used(), _rss()))
    (gpu_a, rss_a), (gpu_b, rss_b) = marks
    print(f"after cycle 3 -> 50: GPU {gpu_a / 2**20:.0f} -> {gpu_b / 2**20:.0f} MiB, "
          f"RSS {rss_a / 2**20:.0f} -> {rss_b / 2**20:.0f} MiB")
    assert gpu_b - gpu_a <= 64 << 20
    assert rss_b - rss_a <= 256 << 20


PRELOAD_SCRIPT = textwrap.dedent("""
    import json, torch
    from rollout_engine import RolloutEngine, SamplingParams
    engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True, weights_cpu_backup=True,
                           max_total_tokens=65536, cuda_graph_max_batch_size=16)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(2000 + i, 2050 + 3 * i)) for i in range(6)]
    before = [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    used = lambda: torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    u0 = used()
    freed = engine.release_memory(["cuda_graph"])
    u1 = used()
    engine.resume_memory(["cuda_graph"])
    engine.release_memory()
    engine.resume_memory()
    after = [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    print("RESULT " + json.dumps(dict(mode=engine._memory.graph_mode, graph_bytes=freed["cuda_graph"],
                                       device_freed=u0 - u1, same=before == after)))
""")


def test_preload_hook_pauses_the_graph_pool(tmp_path):
    pytest.importorskip("torch_memory_saver")
    script = tmp_path / "preload_job.py"
    script.write_text(PRELOAD_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "rollout_engine.cli", "run", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    print(result)
    assert result["mode"] == "pause" and result["same"]
    assert result["graph_bytes"] > 0 and result["device_freed"] >= 0.8 * result["graph_bytes"]
