"""RolloutPool on a local Ray cluster the test starts: two CPU replicas of a
tiny model, compared with one engine (greedy and seeded outputs, cache hits,
sessions, weight updates, a gloo weight-sync group with a trainer process,
replicas killed mid-call)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.slow  # starts a Ray cluster and a pool per test; run by .ci/run after the fast tests

ray = pytest.importorskip("ray")

ENGINE = dict(device="cpu", max_total_tokens=4096)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(12 + i)] for i in range(8)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    first = save_model(make_hf_model("llama", seed=0), tmp_path_factory.mktemp("pool-first"))
    second = save_model(make_hf_model("llama", seed=5, initializer_range=0.2), tmp_path_factory.mktemp("pool-second"))
    return first, second


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def pool(cluster, folders):
    from rollout_engine.integrations.ray import RolloutPool

    p = RolloutPool(folders[0], num_replicas=2, call_timeout_s=120, generate_timeout_s=180,
                    restart_timeout_s=120, **ENGINE)
    yield p
    p.shutdown()


def _single(folder, params, prompts=PROMPTS, **kw):
    engine = RolloutEngine(folder, **ENGINE)
    try:
        return engine.generate(input_ids=prompts, sampling_params=params, **kw)
    finally:
        engine.shutdown()


def _tokens(outs):
    return [o.output_token_ids for o in outs]


def test_outputs_equal_one_engine_and_samples_stay_together(pool, folders):
    assert _tokens(pool.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == _tokens(_single(folders[0], GREEDY))
    want = _single(folders[0], SEEDED)
    pool.flush_cache()  # the greedy call cached these prompts
    got = pool.generate(input_ids=PROMPTS, sampling_params=SEEDED)
    assert _tokens(got) == _tokens(want)
    for a, b in zip(got, want):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    # The n samples of a prompt ran on one replica: the prompt was computed
    # once and its other samples hit the cache, as on one engine.
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert sum(o.num_cached_tokens for o in got) > 0
    # Both replicas took work (least queued tokens).
    assert all(m["output_tokens"] > 0 for m in pool.metrics()), pool.metrics()


def test_session_turns_stick_to_one_replica(pool):
    sessions = [f"s{i}" for i in range(len(PROMPTS))]
    first = pool.generate(input_ids=PROMPTS, sampling_params=GREEDY, session_ids=sessions)
    second_turn = [p + o.output_token_ids + [9, 8, 7] for p, o in zip(PROMPTS, first)]
    second = pool.generate(input_ids=second_turn, sampling_params=GREEDY, session_ids=sessions)
    for p, o in zip(PROMPTS, second):  # the first turn's KV was there to reuse
        assert o.num_cached_tokens >= len(p), (o.request_id, o.num_cached_tokens)


def test_update_weights_reaches_every_replica(pool, folders):
    from rollout_engine.weights.loader import iter_safetensors

    version = pool.update_weights(list(iter_safetensors(folders[1])))
    assert version == 1 == pool.weight_version
    outs = pool.generate(input_ids=PROMPTS * 2, sampling_params=GREEDY)
    assert _tokens(outs) == _tokens(_single(folders[1], GREEDY, PROMPTS * 2))
    assert {o.weight_version for o in outs} == {1}
    assert [r["weight_version"] for r in pool.replicas()] == [1, 1]
    from rollout_engine.fidelity import weights_checksum

    expected = weights_checksum(dict(iter_safetensors(folders[1])), "float32")
    sums = pool.weights_checksum()
    assert sorted(sums) == [0, 1] and all(s == {n: expected[n] for n in s} for s in sums.values())


def test_a_gloo_weight_sync_group_spans_the_trainer_and_every_replica(pool, folders):
    from rollout_engine.integrations.weight_sender import WeightSender
    from rollout_engine.weights.loader import iter_safetensors
    from test_weight_sync import _free_port

    tensors = list(iter_safetensors(folders[1]))
    port = _free_port()
    joined = pool.init_weight_sync_group("127.0.0.1", port, backend="gloo")
    assert joined.world_size == 3  # the trainer and one engine rank per replica
    sender = WeightSender("127.0.0.1", port, world_size=joined.world_size, backend="gloo")
    joined.wait()
    receiving = pool.update_weights_from_distributed(*WeightSender.metadata(tensors))
    sender.send(tensors)
    assert receiving.wait() == 1
    sender.close()
    pool.destroy_weight_sync_group()
    assert _tokens(pool.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == _tokens(_single(folders[1], GREEDY))


def _kill_while_running(pool, index: int, call):
    """Run `call` in a thread, kill replica `index` once it has work, and
    return the call's result."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", call()))
    thread.start()
    deadline = time.monotonic() + 60
    while not pool.replicas()[index].get("unfinished"):
        assert time.monotonic() < deadline, "the replica never got work"
        time.sleep(0.02)
    ray.kill(pool.slot(index).actor, no_restart=False)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the pool call hung after a replica died"
    return result["out"]


def test_a_replica_killed_mid_generate_loses_nothing(pool, folders, caplog):
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 3
    want = _single(folders[0], long, prompts)
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        got = _kill_while_running(pool, 0, lambda: pool.generate(input_ids=prompts, sampling_params=long))
    assert "replica 0 died" in caplog.text  # its part was re-run elsewhere
    assert _tokens(got) == _tokens(want)
    assert all(o.finish_reason == "length" for o in got)
    pool.wait_ready(120)
    assert [r["state"] for r in pool.replicas()] == ["ready", "ready"]


def test_a_replica_killed_mid_stream_delivers_each_token_once(pool, folders, caplog):
    long = SamplingParams(max_new_tokens=150, temperature=0.8, seed=3, ignore_eos=True, logprobs=True)
    prompts = PROMPTS * 2
    want = _single(folders[0], long, prompts)

    def consume():
        pieces: dict[str, list[int]] = {}
        finished = []
        for delta in pool.stream(input_ids=prompts, sampling_params=long):
            pieces.setdefault(delta.request_id, []).extend(delta.output_token_ids)
            if delta.finish_reason is not None:
                finished.append(delta.request_id)
        return pieces, finished

    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        pieces, finished = _kill_while_running(pool, 1, consume)
    assert "replica 1 died" in caplog.text
    assert len(finished) == len(set(finished)) == len(prompts)
    ids = [f"{pool._prefix}-{i}" for i in range(len(prompts))]  # the pool names requests in order
    assert [pieces[i] for i in sorted(pieces, key=lambda r: int(r.rsplit("-", 1)[1]))] == _tokens(want)
    assert sorted(pieces) == sorted(ids)


def test_a_restarted_replica_serves_the_updated_weights(pool, folders):
    from rollout_engine.weights.loader import iter_safetensors

    pool.update_weights(list(iter_safetensors(folders[1])), version=7)
    before = pool.replicas()[1]["pid"]
    ray.kill(pool.slot(1).actor, no_restart=False)
    # A control finds the death; the pool brings the replica back by itself.
    pool.flush_cache()
    time.sleep(0.5)
    pool.replicas()
    pool.wait_ready(120)
    info = pool.replicas()
    assert info[1]["state"] == "ready" and info[1]["pid"] != before and info[1]["weight_version"] == 7
    outs = pool.generate(input_ids=PROMPTS * 2, sampling_params=GREEDY)
    assert _tokens(outs) == _tokens(_single(folders[1], GREEDY, PROMPTS * 2))
    assert {o.weight_version for o in outs} == {7}
    assert all(m["output_tokens"] > 0 for m in pool.metrics())


def test_bad_arguments_are_value_errors_and_the_pool_goes_on(pool, folders):
    from rollout_engine.integrations.ray import RolloutPool

    with pytest.raises(ValueError, match="num_replicas"):
        RolloutPool("x", num_replicas=0)
    with pytest.raises(ValueError, match="exactly one"):
        pool.generate()
    with pytest.raises(ValueError, match="session_ids"):
        pool.generate(input_ids=PROMPTS, session_ids=["a"])
    with pytest.raises(ValueError, match="max_new_tokens"):  # the engine's own check, raised on a replica
        pool.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=10**6))
    with pytest.raises(ValueError, match="mode"):
        pool.pause_generation("sideways")
    with pytest.raises(ValueError, match="distinct"):
        pool.generate(input_ids=PROMPTS[:2], request_ids=["a", "a"])
    with pytest.raises(ValueError, match="max_restarts"):
        RolloutPool(folders[0], max_restarts=-5, device="cpu")
    with pytest.raises(ValueError, match="timeout_s"):
        pool.generate(input_ids=PROMPTS[:1], timeout_s=-1)
    with pytest.raises(ValueError, match="input_ids must be a list"):
        pool.generate(input_ids=5)
    # No prompts: no outputs, at once, as from one engine.
    assert pool.generate(input_ids=[]) == [] and pool.generate(prompts=[]) == []
    assert list(pool.stream(input_ids=[], sampling_params=GREEDY)) == []
    import asyncio

    assert asyncio.run(pool.generate_async(input_ids=[])) == []
    # An early close and a failed call leave no queued work behind in the routing.
    stream = pool.stream(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=200, temperature=0))
    next(stream)
    stream.close()
    assert set(pool._router.queued.values()) == {0}
    # Token ids as numpy arrays or tensors, as the engine takes them.
    import numpy as np
    import torch

    as_lists = _tokens(pool.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY))
    assert _tokens(pool.generate(input_ids=[np.array(p) for p in PROMPTS[:2]], sampling_params=GREEDY)) == as_lists
    assert _tokens(pool.generate(input_ids=[torch.tensor(p) for p in PROMPTS[:2]], sampling_params=GREEDY)) == as_lists
    assert len(pool.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)) == 2


def test_every_call_after_shutdown_refuses_at_once(cluster, folders):
    from rollout_engine.integrations.ray import RolloutPool

    pool = RolloutPool(folders[0], num_replicas=1, device="cpu", max_total_tokens=4096)
    pool.shutdown()
    pool.shutdown()
    for call in (lambda: pool.generate(input_ids=PROMPTS[:1]), lambda: pool.update_weights({}), pool.replicas,
                 lambda: pool.init_weight_sync_group("127.0.0.1", 1), pool.flush_cache):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_bench_grpo_through_a_pool_of_two(cluster, folders, tmp_path):
    import json

    from rollout_engine.cli import main

    out = tmp_path / "pool.json"
    rc = main(["bench", "--workload", "grpo", "--replicas", "2", "--model", folders[0], "--load-format", "auto",
               "--num-prompts", "4", "-n", "4", "--prompt-min", "16", "--prompt-max", "40", "--output-len", "8",
               "--max-total-tokens", "4096", "--out", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    for key in ("replicas_1", "replicas_2"):
        assert results[key]["output_tokens"] == 4 * 4 * 8
        assert results[key]["cache_hit_rate"] >= results[key]["ideal_hit_rate"] == 0.75  # samples stayed together
    assert results["speedup"] > 0


def test_async_pause_and_continue_reach_every_replica(pool, folders):
    import asyncio

    want = _tokens(_single(folders[0], GREEDY))
    assert _tokens(asyncio.run(pool.generate_async(input_ids=PROMPTS, sampling_params=GREEDY))) == want
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    want_long = _tokens(_single(folders[0], long))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", pool.generate(input_ids=PROMPTS,
                                                                                      sampling_params=long)))
    thread.start()
    deadline = time.monotonic() + 60
    while not all(r.get("unfinished") for r in pool.replicas()):
        assert time.monotonic() < deadline, "the replicas never got work"
        time.sleep(0.02)
    pool.pause_generation("keep")  # returns when every replica has paused
    assert all(m["paused"] for m in pool.metrics())
    thread.join(timeout=1.0)
    assert thread.is_alive()  # paused everywhere: nothing finishes
    pool.continue_generation()
    thread.join(timeout=120)
    assert _tokens(result["out"]) == want_long
    # Cancelling the awaiting task aborts its requests on the replicas.
    long = SamplingParams(max_new_tokens=480, temperature=0, ignore_eos=True)

    async def cancel_midway():
        task = asyncio.ensure_future(pool.generate_async(input_ids=PROMPTS * 4, sampling_params=long))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 30
    while any(r["unfinished"] for r in pool.replicas()):
        assert time.monotonic() < deadline, pool.replicas()
        time.sleep(0.1)


def test_a_replica_no_node_can_hold_is_refused_at_once(cluster, folders):
    from rollout_engine.integrations.ray import RolloutPool

    start = time.monotonic()
    with pytest.raises(ValueError, match="GPU"):
        RolloutPool(folders[0], num_replicas=1, device="cuda", call_timeout_s=120)
    with pytest.raises(ValueError, match="CPU"):
        RolloutPool(folders[0], num_replicas=1, tp_size=64, device="cpu", call_timeout_s=120)
    assert time.monotonic() - start < 30


def test_routed_experts_pass_through_the_pool(cluster, tmp_path):
    """MoE routing capture behind the pool: generate and a stream's last
    delta carry each sample's routing, equal to one engine's."""
    import numpy as np

    from rollout_engine.integrations.ray import RolloutPool

    folder = save_model(make_hf_model("qwen3_moe", seed=5), tmp_path / "moe")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True,
                            return_routed_experts=True)
    engine = RolloutEngine(folder, enable_return_routed_experts=True, **ENGINE)
    want = engine.generate(input_ids=PROMPTS[:4], sampling_params=params)
    engine.shutdown()
    pool = RolloutPool(folder, num_replicas=2, call_timeout_s=120, generate_timeout_s=180, restart_timeout_s=120,
                       enable_return_routed_experts=True, **ENGINE)
    try:
        got = pool.generate(input_ids=PROMPTS[:4], sampling_params=params)
        assert _tokens(got) == _tokens(want)
        assert all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(got, want))
        last = {d.request_id: d for d in pool.stream(input_ids=PROMPTS[:1], sampling_params=params)
                if d.finish_reason is not None}
        assert sorted(d.routed_experts.shape[0] for d in last.values()) == [len(PROMPTS[0]) + 7] * 2
    finally:
        pool.shutdown()
