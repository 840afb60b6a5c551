"""Decode attention that reads a shared prompt once a group
(kernels/group_attention.py): the grouping itself, the soundness of what the
scheduler tells it (sequences with the same key hold the same slots over
their shared length, on a real engine with samples, retractions and cache
hits), the Triton backend's step blocks (eager and a graph's, groups
written and cleared), and the kernel pair against the torch reference under
Triton's interpreter (TRITON_INTERPRET=1 where Triton is installed). The
engine on the GPU: tests/test_gpu_differential.py."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.kernels.group_attention import ALIGN, members_per_group, prefix_chunks, prefix_groups

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def test_groups_by_key_cut_to_the_alignment_and_the_member_cap():
    keys = np.array([5, -1, 5, 9, 5, 9, 7, 5, 5], dtype=np.int64)
    shared = np.array([300, 0, 290, 129, 400, 140, 500, 300, 300])
    rows = np.arange(100, 109)
    pg = prefix_groups(keys, shared, rows, members=3)
    # key 5: rows 0 2 4 7 8 -> two groups (3 + 2), each at the least length, cut to 128s
    assert pg.count == 3
    assert pg.members.tolist() == [[0, 2, 4], [7, 8, -1], [3, 5, -1]]
    assert pg.lens.tolist() == [256, 256, 128] and pg.rows.tolist() == [100, 107, 103]
    assert pg.lo.tolist() == [256, 0, 256, 128, 256, 128, 0, 256, 256]  # key 7 alone, -1 none: 0


def test_no_groups_where_nothing_is_shared_enough():
    rows = np.arange(4)
    assert prefix_groups(np.array([1, 1, 2, 2]), np.array([127, 400, 100, 100]), rows, 8).count == 0
    assert prefix_groups(np.array([-1, -1]), np.array([400, 400]), rows[:2], 8).count == 0
    assert prefix_groups(np.array([3, 3]), np.array([400, 400]), rows[:2], 1).count == 0  # one a program: no group
    one = prefix_groups(np.array([3]), np.array([400]), rows[:1], 8)
    assert one.count == 0 and one.lo.tolist() == [0]


def _groups_one_by_one(keys, shared, table_rows, members, min_shared, align):
    """prefix_groups written as a loop over each key's sequences, in batch
    order, cut into pieces of `members`."""
    lo = np.zeros(len(keys), np.int32)
    out = []
    if members >= 2:
        for key in sorted({int(k) for k in keys if k >= 0}):
            seqs = [i for i in range(len(keys)) if keys[i] == key and shared[i] >= min_shared]
            for c in range(0, len(seqs), members):
                part = seqs[c: c + members]
                length = min(int(shared[i]) for i in part) // align * align
                if len(part) >= 2 and length >= max(min_shared, 1):
                    out.append((int(table_rows[part[0]]), length, part + [-1] * (members - len(part))))
                    lo[part] = length
    return out, lo


def test_groups_equal_a_loop_over_each_key_on_random_steps():
    rng = np.random.default_rng(0)
    for _ in range(500):
        b = int(rng.integers(1, 60))
        keys, shared = rng.integers(-1, 6, size=b), rng.integers(0, 700, size=b)
        rows = rng.permutation(200)[:b]
        members, min_shared, align = int(rng.integers(0, 10)), int(rng.choice([1, 128])), int(rng.choice([1, 16, 128]))
        pg = prefix_groups(keys, shared, rows, members, min_shared, align)
        want, lo = _groups_one_by_one(keys, shared, rows, members, min_shared, align)
        got = list(zip(pg.rows.tolist(), pg.lens.tolist(), pg.members.tolist()))
        assert got == want and pg.lo.tolist() == lo.tolist()
        assert pg.rows.dtype == pg.lens.dtype == pg.members.dtype == pg.lo.dtype == np.int32


def test_members_and_chunks():
    assert members_per_group(7) == 9 and members_per_group(4) == 16 and members_per_group(1) == 32
    assert members_per_group(40) == 0  # two sequences' heads would not fit a program
    assert prefix_chunks(32, 4, 132) == 2 and prefix_chunks(64, 4, 132) == 1 and prefix_chunks(1, 1, 132) == 4


class PlanChecker:
    """Wraps a scheduler's runner: for every plan it launches, sequences with
    the same share key must hold the same KV slots over the least of their
    share lengths, and that length must leave their newest token their own."""

    def __init__(self, inner, table):
        self.inner, self.table, self.groups = inner, table, 0

    def launch(self, plan, prev=None):
        if plan.share_keys is not None:
            assert plan.is_decode and len(plan.share_keys) == plan.batch_size
            for key in set(plan.share_keys.tolist()) - {-1}:
                idx = np.flatnonzero(plan.share_keys == key)
                if len(idx) < 2:
                    continue
                n = int(plan.share_lens[idx].min())
                assert n < plan.seq_lens[idx].min(), "the newest token must be a sequence's own"
                first = self.table.table[plan.rows[idx[0]], :n]
                for i in idx[1:]:
                    assert np.array_equal(self.table.table[plan.rows[i], :n], first)
                grouped = prefix_groups(plan.share_keys, plan.share_lens, plan.rows, 32)
                self.groups += grouped.count
        return self.inner.launch(plan, prev)

    def collect(self, handle):
        return self.inner.collect(handle)


@pytest.mark.parametrize("page_size", [1, 16])
def test_share_keys_name_sequences_holding_the_same_slots(llama, page_size):
    _, folder = llama
    # a pool tight enough for retractions; chunks smaller than the prompts
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=800, max_prefill_tokens=96, page_size=page_size)
    sched = engine.core.scheduler
    assert not sched.cfg.share_prefixes  # the torch backend reads no prefix once: its plans name none
    checker = PlanChecker(sched.runner, sched.kv.table)
    engine.core.call(lambda: setattr(sched, "runner", checker))
    engine.core.call(lambda: setattr(sched, "cfg", dataclasses.replace(sched.cfg, share_prefixes=True)))
    rng = np.random.default_rng(page_size)
    prompts = [rng.integers(5, 500, size=int(rng.integers(140, 260))).tolist() for _ in range(3)]
    params = SamplingParams(n=6, temperature=1.0, seed=1, max_new_tokens=40, ignore_eos=True)
    engine.generate(input_ids=prompts, sampling_params=params)
    # follow-up turns share the first call's prompts and part of an output
    engine.generate(input_ids=[p + [7, 8, 9] for p in prompts[:2]], sampling_params=SamplingParams(
        n=4, temperature=0.7, seed=2, max_new_tokens=24, ignore_eos=True))
    engine.core.call(lambda: setattr(sched, "runner", checker.inner))
    engine.check_integrity()
    assert checker.groups > 20
    assert engine.cache_stats()["retractions"] > 0


def test_no_share_keys_without_the_prefix_cache(llama):
    _, folder = llama
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=4096, enable_prefix_cache=False)
    sched = engine.core.scheduler
    engine.core.call(lambda: setattr(sched, "cfg", dataclasses.replace(sched.cfg, share_prefixes=True)))
    seen = []
    inner = sched.runner
    spy = SimpleNamespace(launch=lambda plan, prev=None: seen.append(plan.share_keys) or inner.launch(plan, prev),
                          collect=inner.collect)
    engine.core.call(lambda: setattr(sched, "runner", spy))
    engine.generate(input_ids=[list(range(10, 300))], sampling_params=SamplingParams(n=4, max_new_tokens=8))
    engine.core.call(lambda: setattr(sched, "runner", inner))
    assert seen and all(k is None for k in seen)


def _decode_step(lens, rows, keys=None, shared=None):
    return SimpleNamespace(
        is_decode=True, batch_size=len(lens), seq_lens=np.array(lens, dtype=np.int64),
        rows=np.array(rows, dtype=np.int64), rows_device=torch.tensor(rows), extend_lens=np.ones(len(lens), np.int64),
        attn_metadata=None, share_keys=None if keys is None else np.array(keys, np.int64),
        share_lens=None if shared is None else np.array(shared, np.int64))


def test_triton_backend_step_blocks_carry_the_groups(monkeypatch):
    from rollout_engine.attention import triton_backend
    from rollout_engine.attention.base import AttentionShape
    from rollout_engine.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(triton_backend, "GROUPS", True)
    be = TritonAttentionBackend(AttentionShape(8, 2, 16, 1, torch.float32, torch.device("cpu")))
    assert be.members == 16 and be.reads_shared_prefixes
    lens, rows = [300, 420, 290, 150], [7, 3, 9, 4]
    fb = _decode_step(lens, rows, keys=[1, 1, -1, 1], shared=[280, 280, 0, 280])
    be.init_forward_metadata(fb)
    meta = fb.attn_metadata
    g = meta.groups
    # own keys: 300-256, 420-256, 290, 150-256 < 0 -> sequence 3 (150 tokens) cannot share 256: key 1 least 280
    assert g.rows.tolist() == [7] and g.lens.tolist() == [256] and g.members.tolist()[0][:3] == [0, 1, 3]
    order = meta.order.tolist()
    own = np.array(lens) - np.array([256, 256, 0, 256])
    assert order == np.argsort(-own, kind="stable").tolist()  # by the keys each program walks
    assert g.lo.tolist() == [[256, 256, 0, 256][i] for i in order]
    assert meta.seq_lens.tolist() == [lens[i] for i in order] and meta.rows.tolist() == [rows[i] for i in order]
    assert meta.qo_indptr.tolist() == [0, 1, 2, 3, 4]

    fb = _decode_step(lens, rows)  # no keys: no groups, the plain step
    be.init_forward_metadata(fb)
    assert fb.attn_metadata.groups is None and fb.attn_metadata.qo_indptr.tolist() == [0, 1, 2, 3, 4]

    be.init_graph_buffers(8, 512)
    graph_fb = _decode_step([1] * 8, list(range(8)))
    meta = be.graph_metadata(8, graph_fb)
    graph_fb.attn_metadata = meta
    assert meta.groups.lens.tolist() == [0] * 4 and (meta.groups.members == -1).all()  # no group before a replay
    be.prepare_replay(4, 8, np.array(lens), np.array(rows), graph_fb, (np.array([1, 1, -1, 1]),
                                                                        np.array([280, 280, 0, 280])))
    g = meta.groups
    assert g.lens.tolist() == [256, 0, 0, 0] and g.rows.tolist()[0] == 7
    assert g.members.tolist()[0][:4] == [0, 1, 3, -1] and (g.members[1:] == -1).all()
    assert sorted(zip(meta.order.tolist(), g.lo.tolist())) == list(enumerate([256, 256, 0, 256, 0, 0, 0, 0]))
    be.prepare_replay(4, 8, np.array(lens), np.array(rows), graph_fb, (None, None))  # the next step: none
    assert g.lens.tolist() == [0] * 4 and g.lo.tolist() == [0] * 8


def test_backends_that_must_not_group(monkeypatch):
    from rollout_engine.attention import triton_backend
    from rollout_engine.attention.base import AttentionShape
    from rollout_engine.attention.invariant_backend import BatchInvariantTritonBackend

    shape = AttentionShape(8, 2, 16, 1, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(triton_backend, "GROUPS", True)
    assert BatchInvariantTritonBackend(shape).members == 0  # bits must not depend on the batch
    monkeypatch.setattr(triton_backend, "GROUPS", False)  # the switch off: every sequence its whole context
    be = triton_backend.TritonAttentionBackend(shape)
    fb = _decode_step([300, 300], [1, 2], keys=[4, 4], shared=[300, 300])
    be.init_forward_metadata(fb)
    assert be.members == 0 and not be.reads_shared_prefixes and fb.attn_metadata.groups is None


def _case(hq, hk, d, groups, alone, dtype, seed, e4m3=False):
    """Sequences of `groups` ((members, shared tokens), each member with
    1-150 own tokens) and `alone` (lengths) in a shuffled batch; slots
    scattered. Returns q, k, v, table, table rows, lengths, keys, shared."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    slots = 8192
    k = torch.randn(slots, hk, d, generator=g).to(dtype)
    v = torch.randn(slots, hk, d, generator=g).to(dtype)
    if e4m3:  # bf16 queries over an e4m3 cache: both launches multiply in fp16
        k, v = (x.mul(3).clamp(-448, 448).to(torch.float8_e4m3fn) for x in (k, v))
    free = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    seqs, keys, shared = [], [], []
    for gi, (n, length) in enumerate(groups):
        pre = [free.pop() for _ in range(length)]
        for _ in range(n):
            seqs.append(pre + [free.pop() for _ in range(int(rng.integers(1, 150)))])
            keys.append(gi)
            shared.append(length)
    for length in alone:
        seqs.append([free.pop() for _ in range(length)])
        keys.append(-1)
        shared.append(0)
    perm = rng.permutation(len(seqs))
    seqs = [seqs[i] for i in perm]
    table = torch.zeros(len(seqs) + 1, max(map(len, seqs)), dtype=torch.int32)
    for i, s in enumerate(seqs):
        table[i + 1, : len(s)] = torch.tensor(s)
    q = torch.randn(len(seqs), hq, d, generator=g).to(dtype)
    return (q, k, v, table, np.arange(1, len(seqs) + 1), np.array([len(s) for s in seqs], np.int32),
            np.array(keys)[perm], np.array(shared)[perm])


@interpreted
@pytest.mark.parametrize("hq,hk,chunks,e4m3", [(8, 2, 1, False), (8, 2, 4, False), (14, 2, 2, False),
                                               (4, 4, 8, False), (6, 2, 2, False), (8, 2, 2, True)])
def test_interpreted_kernel_pair_matches_reference(hq, hk, chunks, e4m3):
    from rollout_engine.kernels.attention import decode_attention, in_order, longest_first, paged_attention_ref
    from rollout_engine.kernels.group_attention import prefix_attention

    q, k, v, table, rows, lens, keys, shared = _case(hq, hk, 16, [(6, 300), (2, 140), (3, 128)], [40, 200],
                                                     torch.bfloat16 if e4m3 else torch.float32, seed=hq + chunks,
                                                     e4m3=e4m3)
    pg = prefix_groups(keys, shared, rows, min(members_per_group(hq // hk), 4))  # 6 members: two programs
    assert pg.count == 4 and pg.lens.tolist().count(256) == 2
    i32 = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))  # noqa: E731
    part, ml = prefix_attention(q, k, v, table, i32(pg.rows), i32(pg.lens), i32(pg.members), 0.25, chunks, len(lens))
    order = longest_first(lens - pg.lo)
    r, n, lo = in_order(order, rows, lens, pg.lo)
    out = decode_attention(q, k, v, table, i32(r), i32(n), 0.25, i32(order), prefix=(i32(lo), part, ml))
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, rows.tolist(), lens.tolist(), [1] * len(lens),
                              0.25)
    if e4m3:  # against the batch kernel alone too: the same fp16 products, another order of the sums
        plain = decode_attention(q, k, v, table, i32(rows), i32(lens), 0.25)
        torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), ref, atol=4e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert ALIGN % 32 == 0  # the batch kernel's own walk starts on a block of any of its tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hk,e4m3", [(28, 4, False), (32, 8, False), (16, 8, False), (28, 4, True)])
def test_gpu_kernel_pair_replayed_over_other_groups(hq, hk, e4m3):
    """The pair captured once in a CUDA graph with room for batch // 2
    groups (as a decode graph holds them), then replayed over other groups,
    lengths and rows, and over none: each replay matches the reference."""
    from rollout_engine.kernels.attention import decode_attention, in_order, longest_first, paged_attention_ref
    from rollout_engine.kernels.group_attention import prefix_attention

    dev = torch.device("cuda")
    width = members_per_group(hq // hk)
    cases = [_case(hq, hk, 128, groups, alone, torch.bfloat16, seed=s, e4m3=e4m3)
             for s, (groups, alone) in enumerate([([(8, 640), (8, 300), (3, 129)], [50, 700]),
                                                  ([(4, 1000), (2, 128)], [900, 3, 5, 60]),
                                                  ([], [100] * 12)])]
    bs = max(len(c[5]) for c in cases)
    gc = bs // 2
    slots = max(c[1].shape[0] for c in cases)
    k = torch.zeros(slots, hk, 128, dtype=cases[0][1].dtype, device=dev)
    v = torch.zeros_like(k)
    table = torch.zeros(bs + 1, max(c[3].shape[1] for c in cases), dtype=torch.int32, device=dev)
    q = torch.zeros(bs, hq, 128, dtype=torch.bfloat16, device=dev)
    ints = torch.zeros(4 * bs + gc * (2 + width), dtype=torch.int32, device=dev)
    lens, rows, order, lo = (ints[i * bs: (i + 1) * bs] for i in range(4))
    g_rows, g_lens = ints[4 * bs: 4 * bs + gc], ints[4 * bs + gc: 4 * bs + 2 * gc]
    members = ints[4 * bs + 2 * gc:].view(gc, width)

    def step():
        part, ml = prefix_attention(q, k, v, table, g_rows, g_lens, members, 128 ** -0.5, 2, bs)
        return decode_attention(q, k, v, table, rows, lens, 128 ** -0.5, order, prefix=(lo, part, ml))

    ints.fill_(0)
    lens.fill_(1)
    order.copy_(torch.arange(bs))
    members.fill_(-1)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for cq, ck, cv, ct, crows, clens, keys, shared in cases:
        b = len(clens)
        for x in (k, v, table, q):
            x.view(torch.uint8).zero_()  # (an e4m3 cache too)
        k[: ck.shape[0]].copy_(ck)
        v[: cv.shape[0]].copy_(cv)
        table[: ct.shape[0], : ct.shape[1]].copy_(ct)
        q[:b].copy_(cq)
        pg = prefix_groups(keys, shared, crows, width)
        all_lens, all_rows, all_lo = np.ones(bs, np.int32), np.zeros(bs, np.int64), np.zeros(bs, np.int32)
        all_lens[:b], all_rows[:b], all_lo[:b] = clens, crows, pg.lo
        o = longest_first(all_lens - all_lo)
        gr, gl, gm = np.zeros(gc, np.int32), np.zeros(gc, np.int32), np.full((gc, width), -1, np.int32)
        gr[: pg.count], gl[: pg.count], gm[: pg.count] = pg.rows, pg.lens, pg.members
        host = np.concatenate([*in_order(o, all_lens, all_rows), o, *in_order(o, all_lo), gr, gl, gm.ravel()])
        ints.copy_(torch.from_numpy(host))
        graph.replay()
        ref = paged_attention_ref(cq.float(), ck.float(), cv.float(), ct, crows.tolist(), clens.tolist(), [1] * b,
                                  128 ** -0.5)
        torch.testing.assert_close(out[:b].float().cpu(), ref, atol=4e-2 if e4m3 else 2e-2, rtol=1e-2)
