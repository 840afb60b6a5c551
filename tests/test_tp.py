"""Tensor parallelism on the CPU over gloo (standalone: the engine spawns its
other ranks). Greedy tokens equal tp_size=1 in fp32 on models with peaked
logits, raw logprobs within 1e-4; the prefix cache, n > 1, chunked prefill
and retraction under a tight pool run through the same plans on every rank;
weight updates (in-process and over a weight-sync group) reach every rank."""
from __future__ import annotations

import logging
import multiprocessing as mp

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

SYSTEM = list(range(20, 52))
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], [6, 7, 8, 9, 10], list(range(100, 170))]


def _folder(tmp_path_factory, kind: str, **overrides) -> str:
    model = make_hf_model(kind, seed=3, initializer_range=0.2, **overrides)
    return save_model(model, tmp_path_factory.mktemp(f"tp-{kind}"))


def _run(folder: str, tp: int, new_tokens: int = 12, **kw) -> list:
    engine = RolloutEngine(folder, device="cpu", tp_size=tp, **{"max_total_tokens": 4096, **kw})
    try:
        greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=True,
                                logprob_mode="raw")
        outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy)
        outs += engine.generate(input_ids=PROMPTS[:2], sampling_params=SamplingParams(
            n=3, max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=True, logprob_mode="raw"))
        engine.check_integrity()
        stats = engine.cache_stats()
        return outs, stats
    finally:
        engine.shutdown()


def _same(a: list, b: list) -> None:
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    worst = max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.output_logprobs, ob.output_logprobs))
    assert worst < 1e-4


MATRIX = [
    ("llama", {}),
    pytest.param("qwen2", {}, marks=pytest.mark.slow),  # qkv biases
    ("qwen3", {"vocab_size": 509}),  # q/k norms; a vocabulary not divisible by the ranks
    pytest.param("llama", {"num_key_value_heads": 1}, marks=pytest.mark.slow),  # fewer KV heads than ranks: replicated
    ("qwen3_moe", {}),  # experts: each rank a slice of every expert's intermediate dimension; a dense layer
    ("olmoe", {"num_key_value_heads": 1}),  # q/k norms over projections split between ranks (k replicated)
    pytest.param("qwen2_moe", {}, marks=pytest.mark.slow),  # the shared expert, reduced with the experts
    pytest.param("mixtral", {}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,overrides", MATRIX, ids=["llama", "qwen2", "qwen3-odd-vocab", "llama-1kv", "qwen3-moe",
                                                        "olmoe-1kv", "qwen2-moe", "mixtral"])
def test_tp2_equals_tp1(tmp_path_factory, kind, overrides):
    folder = _folder(tmp_path_factory, kind, **overrides)
    one, _ = _run(folder, 1, max_prefill_tokens=40)
    two, stats = _run(folder, 2, max_prefill_tokens=40)  # chunked prefill of the long prompt
    _same(one, two)
    assert stats["matched_tokens"] > 0  # the shared system prompt came from the prefix cache


@pytest.mark.parametrize("mode", ["", "fused", "one-shot"], ids=["unset", "fused", "one-shot"])
@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen3", {"vocab_size": 509})], ids=["llama", "qwen3"])
def test_tp2_with_or_without_the_norms_taking_the_all_reduce_equals_tp1(tmp_path_factory, monkeypatch, caplog, kind,
                                                                        overrides, mode):
    """ROLLOUT_ENGINE_ALLREDUCE unset or fused: the o_proj and down products
    leave their partial sums to the norm after them, which all-reduces them
    (in one kernel on the GPU; on the CPU in two steps, the same structure);
    one-shot: each product all-reduces its own sum, each norm is its own
    step. Either way, with chunked prefill and the prefix cache: tokens and
    logprobs as tp_size=1."""
    folder = _folder(tmp_path_factory, kind, **overrides)
    one, _ = _run(folder, 1, max_prefill_tokens=40)
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", mode)
    with caplog.at_level(logging.INFO, logger="rollout_engine"):
        two, _ = _run(folder, 2, max_prefill_tokens=40)
    assert ("each norm sums the ranks' partial results" in caplog.text) == (mode != "one-shot")
    assert "all-reduces over gloo" in caplog.text
    _same(one, two)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_the_fused_all_reduce_and_norm_equals_nccl_then_the_norm_kernel():
    """Two GPUs: FlashInfer's one-kernel all-reduce + residual add + RMSNorm
    is set up, and gives the residual stream bit for bit and the normalised
    rows within one bf16 rounding (it rounds once, after the weight, where
    the norm kernel rounds before it) of NCCL's sum then the norm kernel,
    eagerly and replayed in a CUDA graph."""
    import sync_workers

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for rank, kind, gap, equal in _on_two_ranks(sync_workers.fused_norm_rank, timeout_s=400):
        print(f"rank {rank}: {kind}, largest gap {gap:.4g}, residual equal {equal}")
        assert kind == "FusedAllReduceNorm" and equal and gap <= 0.0625, (rank, kind, gap, equal)


def test_a_wrong_all_reduce_path_is_refused_by_name_before_any_rank_starts(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", "Fast")
    with pytest.raises(ValueError, match="ROLLOUT_ENGINE_ALLREDUCE must be 'fused', 'one-shot' or 'nccl' "
                                         r"\(or unset: 'fused'\), got 'Fast'"):
        RolloutEngine(_folder(tmp_path_factory, "llama"), device="cpu", tp_size=2, max_total_tokens=512)
    assert mp.active_children() == []  # refused before the other rank was spawned


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_fp8_tp2_holds_what_tp1_does_and_computes_as_its_ranks_quantize(tmp_path_factory):
    """quantization="fp8": every rank's slice is quantized with the scales of
    whole rows, so the weights (checksums) equal tp_size 1's. Activations are
    quantized per token over what each rank holds, so the input of o_proj and
    down_proj gets one scale per token and rank: the engine equals the fp32
    oracle that quantizes so (`assert_near_oracle`), not tp_size 1 (whose
    differences are fp8's rounding, ~0.1 nat on these peaked tiny models)."""
    from differential import Reference, fp8_oracle
    from test_fp8_engine import assert_near_oracle

    hf = make_hf_model("qwen2_moe", seed=3, initializer_range=0.2)  # qkv biases, row-split o/down, shared expert
    folder = save_model(hf, tmp_path_factory.mktemp("tp-fp8"))
    sums = []
    for tp in (1, 2):
        engine = RolloutEngine(folder, device="cpu", tp_size=tp, max_total_tokens=4096, quantization="fp8")
        try:
            sums.append(engine.weights_checksum())
            outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
                max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True, logprob_mode="raw"))
        finally:
            engine.shutdown()
        assert_near_oracle(outs, PROMPTS, Reference(fp8_oracle(hf, tp), "cpu"), Reference(hf, "cpu"), tp)
    assert sums[0] == sums[1]


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_tp4_equals_tp1_with_retraction_under_a_tight_pool(tmp_path_factory):
    folder = _folder(tmp_path_factory, "llama", num_key_value_heads=2, vocab_size=510)
    one, _ = _run(folder, 1, 60, max_total_tokens=200, max_prefill_tokens=64)
    four, stats = _run(folder, 4, 60, max_total_tokens=200, max_prefill_tokens=64)
    _same(one, four)
    assert stats["retractions"] > 0


def test_update_weights_reaches_every_rank(tmp_path_factory):
    first = _folder(tmp_path_factory, "qwen2")
    second = make_hf_model("qwen2", seed=9, initializer_range=0.2)
    second_folder = save_model(second, tmp_path_factory.mktemp("tp-second"))
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    expected = RolloutEngine(second_folder, device="cpu", max_total_tokens=4096).generate(
        input_ids=PROMPTS, sampling_params=params)
    engine = RolloutEngine(first, device="cpu", max_total_tokens=4096, tp_size=2)
    try:
        before = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert engine.update_weights(second.state_dict()) == 1
        after = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o.output_token_ids for o in after] == [o.output_token_ids for o in expected]
        assert [o.output_token_ids for o in before] != [o.output_token_ids for o in after]
        engine.update_weights_from_disk(first)
        again = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o.output_token_ids for o in again] == [o.output_token_ids for o in before]
        with pytest.raises(ValueError, match="unknown weight name"):
            engine.update_weights({"bogus.weight": second.state_dict()["lm_head.weight"]})
        assert engine.generate(input_ids=PROMPTS[:1], sampling_params=params)[0].output_token_ids == \
            before[0].output_token_ids
        # Streamed (a generator; the other rank receives each tensor by
        # broadcast): a NaN half-way fails on every rank without a hang...
        items = list(second.state_dict().items())
        poisoned = ((n, t.clone().fill_(float("nan")) if i == len(items) // 2 else t) for i, (n, t) in enumerate(items))
        with pytest.raises(ValueError, match="non-finite|NaN|inf"):
            engine.update_weights(poisoned)
        with pytest.raises(RuntimeError):
            engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
        # ... and a complete streamed update brings every rank to the new weights.
        assert engine.update_weights((n, t) for n, t in items) == 3
        streamed = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o.output_token_ids for o in streamed] == [o.output_token_ids for o in expected]
    finally:
        engine.shutdown()


@pytest.mark.slow  # trainer and engine ranks over gloo (~20 s); run by .ci/run after the fast tests
def test_weight_sync_broadcast_reaches_every_rank(tmp_path_factory):
    from test_weight_sync import check_trainer_broadcast

    folder_b = save_model(make_hf_model("llama", seed=11), tmp_path_factory.mktemp("tp-sync-b"))
    check_trainer_broadcast(_folder(tmp_path_factory, "llama"), folder_b, tp_size=2)


@pytest.mark.parametrize("tp,overrides,match", [
    (3, {}, "attention heads"),
    (4, {"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96}, "attention heads"),
    (2, {"intermediate_size": 129}, "intermediate size"),
])
def test_a_tp_size_that_does_not_split_the_model_is_refused(tmp_path_factory, tp, overrides, match):
    folder = _folder(tmp_path_factory, "llama", **overrides)
    with pytest.raises(ValueError, match=match):
        RolloutEngine(folder, device="cpu", max_total_tokens=1024, tp_size=tp)
    assert not [p for p in mp.active_children() if p.name.startswith("rollout-engine-tp")]


def _embedded(world: int, tp: int, folder: str, second_folder: str, env: list | None = None) -> list:
    import sync_workers
    from test_weight_sync import _free_port, _gather

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=sync_workers.embedded_rank,
                         args=(r, world, port, folder, second_folder, tp, PROMPTS, out, env)) for r in range(world)]
    for p in procs:
        p.start()
    return sorted(_gather(procs, out, world), key=lambda r: r[0])


@pytest.mark.parametrize("world,tp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow),
                                      pytest.param(4, 4, marks=pytest.mark.slow)])
def test_embedded_ranks_form_engines_and_agree(tmp_path_factory, world, tp):
    """Every rank of a gloo job constructs RolloutEngine(tp_size=tp); each
    consecutive block of tp ranks is one engine, and every rank returns the
    outputs tp_size=1 gives, before and after an update from its own tensors."""
    folder = _folder(tmp_path_factory, "llama")
    second = make_hf_model("llama", seed=9, initializer_range=0.2)
    second_folder = save_model(second, tmp_path_factory.mktemp("emb-second"))
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want_first = [o.output_token_ids for o in RolloutEngine(folder, device="cpu", max_total_tokens=4096).generate(
        input_ids=PROMPTS, sampling_params=params)]
    want_second = [o.output_token_ids for o in RolloutEngine(second_folder, device="cpu",
                                                             max_total_tokens=4096).generate(
        input_ids=PROMPTS, sampling_params=params)]
    for rank, first, streamed, version, after in _embedded(world, tp, folder, second_folder):
        assert first == want_first, rank
        assert streamed == want_first[:2], rank
        assert version == 1 and after == want_second, rank


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_a_wrong_all_reduce_path_on_one_embedded_rank_is_refused_on_every_rank(tmp_path_factory):
    """Embedded ranks read their own environments: a wrong
    ROLLOUT_ENGINE_ALLREDUCE on rank 1 alone is refused on both ranks (rank
    0 alone waited in its next collective), rank 1's error naming it."""
    folder = _folder(tmp_path_factory, "llama")
    results = _embedded(2, 2, folder, folder, env=[{"ROLLOUT_ENGINE_ALLREDUCE": "fused"},
                                                   {"ROLLOUT_ENGINE_ALLREDUCE": "fast"}])
    assert [r[1] for r in results] == ["ValueError"] * 2, results
    assert "on another rank of this engine" in results[0][2] and "got 'fast'" in results[1][2], results


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_embedded_world_not_a_multiple_of_tp_size_is_refused_on_every_rank(tmp_path_factory):
    folder = _folder(tmp_path_factory, "llama")
    results = _embedded(3, 2, folder, folder)
    assert [r[1] for r in results] == ["ValueError"] * 3
    assert all("must divide the world size 3" in r[2] for r in results)


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_workers_exit_when_the_engine_process_is_killed(tmp_path_factory):
    import signal
    import subprocess
    import sys
    import time

    folder = _folder(tmp_path_factory, "llama")
    script = (f"from rollout_engine import RolloutEngine\n"
              f"e = RolloutEngine({str(folder)!r}, device='cpu', max_total_tokens=1024, tp_size=2)\n"
              f"import multiprocessing as mp, sys\n"
              f"print(*[p.pid for p in mp.active_children()], flush=True)\n"
              f"sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in workers if _running(pid)]
        assert not alive, "orphaned tensor-parallel workers"
    finally:
        if proc.poll() is None:
            proc.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_get_weight_joins_every_rank_part(tmp_path_factory):
    """Column, row, fused q/k/v (with KV heads replicated over ranks), gate/up,
    the padded vocabulary and replicated norms: the whole HF tensor back."""
    hf = make_hf_model("qwen2", seed=5, num_key_value_heads=1, vocab_size=509)
    folder = save_model(hf, tmp_path_factory.mktemp("tp-read"))
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024, tp_size=4)
    try:
        state = hf.state_dict()
        for name in engine.weight_names():
            assert torch.equal(engine.get_weight(name), state[name]), name
        with pytest.raises(ValueError, match="unknown weight name"):
            engine.get_weight("bogus.weight")
    finally:
        engine.shutdown()


@pytest.mark.parametrize("on_gpu", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def test_fsdp_over_two_ranks_syncs_into_one_tp2_engine(tmp_path_factory, on_gpu):
    """FSDP2 over two ranks (gloo on the CPU; NCCL, one GPU each), and one
    TP=2 engine over the same two processes: `sync_to_engine` on both ranks,
    then both return the outputs of a fresh engine on the trainer's weights."""
    import sync_workers
    from test_weight_sync import _free_port, _gather

    if on_gpu and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")

    folder_a = _folder(tmp_path_factory, "llama")
    folder_b = save_model(make_hf_model("llama", seed=13), tmp_path_factory.mktemp("fsdp-b"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=sync_workers.fsdp_rank,
                         args=(r, port, folder_a, folder_b, 2, out, PROMPTS, 2, on_gpu)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(_gather(procs, out, 2))
    where = dict(device="cuda", dtype="float32") if on_gpu else dict(device="cpu")  # as the ranks' engine
    fresh = RolloutEngine(folder_b, max_total_tokens=2048, **where).generate(
        input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    for rank, version, tokens in results:
        assert version == 1 and tokens == [o.output_token_ids for o in fresh], rank


def test_a_group_name_used_before_on_any_rank_skips_the_one_shot_setup():
    """torch keeps symmetric-memory state per group name for the life of a
    process, and a second standalone engine in the same process gets the same
    world name again while its new workers do not: setting up under that
    name waited forever on two GPUs. Every rank must agree to skip it."""
    import sync_workers

    assert _on_two_ranks(sync_workers.symm_name_rank) == [(0, False, True, False), (1, False, True, False)]


def test_ranks_reading_different_all_reduce_paths_are_refused_together():
    """Ranks of an engine inside a torch.distributed job read their own
    environments: different ROLLOUT_ENGINE_ALLREDUCE paths would put their
    setup collectives out of step on GPUs (a hang), and a wrong value on one
    rank alone would leave the others waiting: every rank gets the error."""
    import sync_workers

    results = _on_two_ranks(sync_workers.allreduce_mode_rank)
    for rank, differ, same, wrong, mixed_on_cpu in results:
        assert differ is not None and "differs between the ranks of one engine" in differ, (rank, differ)
        assert same is None and mixed_on_cpu is None, (rank, same, mixed_on_cpu)
    assert "'nccl'" in results[0][1] and "'fused'" in results[1][1]  # rank 1's unset: the default
    # A wrong value on one rank: every rank refused, that rank's error naming it.
    assert "on another rank of this engine is not 'fused', 'one-shot' or 'nccl'" in results[0][3]
    assert "must be 'fused', 'one-shot' or 'nccl'" in results[1][3] and "got 'fast'" in results[1][3]


def _on_two_ranks(target, timeout_s: float = 240.0) -> list:
    """`target(rank, port, out_queue)` in two spawned processes: what each
    put, sorted (a worker that dies or hangs fails the test)."""
    import sync_workers
    from test_weight_sync import _free_port, _gather

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=sync_workers.exit_when_done, args=(target, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    return sorted(_gather(procs, out, 2, timeout_s=timeout_s))


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tmp_path_factory, tmp_path):
    """Workers start with multiprocessing's spawn, which imports the main
    script again; without `if __name__ == "__main__":` the worker fails on
    its way in, and the engine says so at once instead of waiting for it."""
    import subprocess
    import sys

    folder = _folder(tmp_path_factory, "llama")
    script = tmp_path / "no_guard.py"
    script.write_text("from rollout_engine import RolloutEngine\n"
                      f"RolloutEngine({str(folder)!r}, device='cpu', tp_size=2, max_total_tokens=512)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "worker 1 exited" in proc.stderr and '__name__ == "__main__"' in proc.stderr
