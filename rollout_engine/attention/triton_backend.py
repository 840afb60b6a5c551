"""Triton paged attention (kernels/attention.py): for GPUs without FlashInfer,
and the decode steps a FlashInfer backend sends here
(`flashinfer_backend.triton_decode_rows`). Reads K/V through the device
request table, so no page-index build is needed. A decode step of one
sequence takes `kernels.one_seq_attention` (one launch whose programs split
the keys, where the batch kernel has one per sequence and KV head, started
longest sequence first)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.one_seq import ONE_SEQ, one_seq, one_seq_shape, takes_one_seq
from rollout_engine.kernels.attention import decode_attention, extend_attention, in_order, longest_first
from rollout_engine.kernels.group_attention import (PrefixGroups, members_per_group, prefix_attention, prefix_chunks,
                                                    prefix_groups)

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch


# Decode steps start their longest sequences first (`decode_attention`'s
# `order`): with ragged lengths, programs started in row order left the long
# sequences running alone at the end (BENCHMARKS.md, "Longest first"). Read
# per step and when a graph is captured (A/B runs set it before).
LONGEST_FIRST = True
# Decode steps whose sequences hold the same prefix (the plan's share_keys: the
# n samples of a prompt) read its keys once a group (`kernels.group_attention`),
# where the steps are ordered. Off until an engine run measures it: the kernels
# alone are 6-19% faster with groups of 8 and cost steps without groups up to
# 10% in their first version (BENCHMARKS.md, "Shared prompts read once a
# group"). Read when the backend is built (A/B runs set it before).
GROUPS = False


class GroupMetadata(NamedTuple):
    """A decode step's prefix groups on the device (`prefix_groups`): where
    each sequence's own keys start (in the step's order), and per group its
    first member's request-table row, shared length and members."""
    lo: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    members: torch.Tensor
    chunks: int


class TritonMetadata(NamedTuple):
    """A step's metadata. With an `order` (decode steps, longest first), the
    lengths and the request-table `rows` are in that order (`in_order`);
    without one, `rows` is None: the step's own device rows. `groups`: the
    step's prefix groups, if it reads shared prefixes once."""
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    max_q_len: int
    order: torch.Tensor | None
    rows: torch.Tensor | None
    groups: GroupMetadata | None = None


class TritonAttentionBackend(AttentionBackend):
    needs_device_table = True
    supports_cuda_graph = True
    orders_decode = True  # decode steps start their longest sequences first (with LONGEST_FIRST)
    shares_prefixes = True  # decode steps read a shared prefix once a group (with GROUPS and the order)

    def __init__(self, shape: AttentionShape, **_):
        self.shape = shape
        self.one_seq = one_seq_shape(shape)
        # sequences a prefix program takes; 0: no groups
        group = shape.num_heads // shape.num_kv_heads
        self.members = members_per_group(group) if GROUPS and self.shares_prefixes else 0
        self._sms: int | None = None  # the device's multiprocessors, read when groups first need them

    @property
    def reads_shared_prefixes(self) -> bool:
        return bool(self.members)

    def _groups(self, shares: tuple | None, rows: np.ndarray) -> PrefixGroups | None:
        """The step's prefix groups from the plan's (share_keys, share_lens), or None."""
        if not self.members or shares is None or shares[0] is None:
            return None
        pg = prefix_groups(shares[0], shares[1], rows, self.members)
        return pg if pg.count else None

    def _chunks(self, groups: int) -> int:
        if self._sms is None:
            cuda = self.shape.device.type == "cuda" and torch.cuda.is_available()
            self._sms = torch.cuda.get_device_properties(self.shape.device).multi_processor_count if cuda else 132
        return prefix_chunks(groups, self.shape.num_kv_heads, self._sms)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if takes_one_seq(self.one_seq, fb):
            fb.attn_metadata = ONE_SEQ
            return
        b = fb.batch_size
        qo_indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(fb.extend_lens, out=qo_indptr[1:])
        lens = fb.seq_lens.astype(np.int32)
        max_q = int(fb.extend_lens.max())
        if not (fb.is_decode and LONGEST_FIRST and self.orders_decode):
            dev = torch.from_numpy(np.concatenate([lens, qo_indptr])).to(self.shape.device, non_blocking=True)
            fb.attn_metadata = TritonMetadata(dev[:b], dev[b:], max_q, None, None)
            return
        pg = self._groups((fb.share_keys, fb.share_lens), fb.rows)
        cap = pg.count if pg is not None else 0
        block = self._ordered_block(lens, fb.rows, pg, cap)
        dev = torch.from_numpy(np.concatenate([block, qo_indptr])).to(self.shape.device, non_blocking=True)
        groups = self._group_views(dev, b, cap, self._chunks(cap)) if cap else None
        fb.attn_metadata = TritonMetadata(dev[:b], dev[block.size:], max_q, dev[2 * b: 3 * b], dev[b: 2 * b], groups)

    def _ordered_block(self, lens: np.ndarray, rows: np.ndarray, pg: PrefixGroups | None, cap: int) -> np.ndarray:
        """The int32 block an ordered decode step reads: lengths and
        request-table rows in the order, the order (longest own walk first);
        with room for `cap` groups, each sequence's `lo` in the order, then
        the groups' rows, lengths and members (places past the step's groups
        empty). `pg` covers the first len(pg.lo) of the rows (a graph's
        padding rows after them)."""
        lo = np.zeros(len(lens), dtype=np.int32)
        if pg is not None:
            lo[: len(pg.lo)] = pg.lo
        order = longest_first(lens - lo)  # by the keys each program walks
        parts = [*in_order(order, lens, rows), order]
        if cap:
            g_rows, g_lens = np.zeros(cap, np.int32), np.zeros(cap, np.int32)
            members = np.full((cap, self.members), -1, np.int32)
            if pg is not None:
                g_rows[: pg.count], g_lens[: pg.count], members[: pg.count] = pg.rows, pg.lens, pg.members
            parts += [*in_order(order, lo), g_rows, g_lens, members.ravel()]
        return np.concatenate(parts)

    def _group_views(self, buf: torch.Tensor, b: int, cap: int, chunks: int) -> GroupMetadata:
        """The groups' part of a device block laid out by `_ordered_block` for
        b sequences and `cap` groups."""
        at = 4 * b + 2 * cap
        return GroupMetadata(buf[3 * b: 4 * b], buf[4 * b: 4 * b + cap], buf[4 * b + cap: at],
                             buf[at: at + cap * self.members].view(cap, self.members), chunks)

    # ---- captured decode steps: the kernels read lengths, rows and order from static buffers --
    def _graph_ints(self, bs: int) -> int:
        """int32 entries of a graph's step block: lengths, request-table rows,
        the order; with groups, each sequence's `lo`, then room for bs // 2
        groups (rows, lengths, members)."""
        return 3 * bs + (bs + (bs // 2) * (2 + self.members) if self._graph_groups(bs) else 0)

    def _graph_groups(self, bs: int) -> bool:
        return bool(self.members) and bs >= 2 and LONGEST_FIRST and self.orders_decode

    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        dev = self.shape.device
        # A graph of `bs` rows reads its lengths at [0, bs) and, ordered, its request-table rows at [bs, 2 bs)
        # and the order at [2 bs, 3 bs), then its groups (`_graph_ints`): one copy fills them.
        self.step_buf = torch.ones(max(self._graph_ints(b) for b in range(1, max_bs + 1)), dtype=torch.int32,
                                   device=dev)
        self.qo_indptr_buf = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        if takes_one_seq(self.one_seq, fb):
            return ONE_SEQ
        lens, qo_indptr = self.step_buf[:bs], self.qo_indptr_buf[: bs + 1]
        if not (LONGEST_FIRST and self.orders_decode):
            return TritonMetadata(lens, qo_indptr, 1, None, None)
        rows, order = self.step_buf[bs: 2 * bs], self.step_buf[2 * bs: 3 * bs]
        # until the first replay writes them: the captured batch's rows, in row order, and no groups
        rows.copy_(fb.rows_device[:bs])
        order.copy_(torch.arange(bs, dtype=torch.int32, device=order.device))
        groups = None
        if self._graph_groups(bs):
            gc = bs // 2
            self.step_buf[3 * bs: 4 * bs + 2 * gc].zero_()
            self.step_buf[4 * bs + 2 * gc: self._graph_ints(bs)].fill_(-1)
            groups = self._group_views(self.step_buf, bs, gc, self._chunks(max(1, bs // 8)))  # groups of 8 assumed
        return TritonMetadata(lens, qo_indptr, 1, order, rows, groups)

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, rows: np.ndarray,
                       fb: "ForwardBatch", shares: tuple | None = None) -> None:
        if fb.attn_metadata is ONE_SEQ:  # the kernel reads the length on the device
            return
        # Padding rows attend over one token (row 0's first slot) and are discarded.
        lens = np.ones(bucket, dtype=np.int32)
        lens[:bs] = seq_lens
        meta = fb.attn_metadata
        if meta.order is None:
            host = lens
        else:
            all_rows = np.zeros(bucket, dtype=np.int64)
            all_rows[:bs] = rows
            pg = self._groups(shares, rows) if meta.groups is not None else None
            # every group place written: those past the step's groups empty
            host = self._ordered_block(lens, all_rows, pg, bucket // 2 if meta.groups is not None else 0)
        self.step_buf[: host.size].copy_(torch.from_numpy(host).to(self.shape.device, non_blocking=True))

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        if fb.attn_metadata is ONE_SEQ:
            return one_seq(q, layer, fb)
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        meta = fb.attn_metadata
        table = fb.table.tensor
        if fb.is_decode:
            rows = fb.rows_device if meta.order is None else meta.rows
            prefix = None
            if meta.groups is not None:
                g = meta.groups
                part, ml = prefix_attention(q, k_cache, v_cache, table, g.rows, g.lens, g.members, layer.scaling,
                                            g.chunks, q.shape[0])
                prefix = (g.lo, part, ml)
            return decode_attention(q, k_cache, v_cache, table, rows, meta.seq_lens, layer.scaling, meta.order,
                                    prefix)
        return extend_attention(q, k_cache, v_cache, table, fb.rows_device, meta.seq_lens, meta.qo_indptr,
                                meta.max_q_len, layer.scaling)
