"""Allocator, request table, KV manager and the integrity check, without a model."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.prefix_cache import NoPrefixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.kv_manager import KVManager


def _manager(num_pages=8, page_size=4):
    alloc = PageAllocator(num_pages, page_size)
    return KVManager(alloc, ReqToTokenTable(4, 64), NoPrefixCache(alloc))


def _req(n_prompt=5):
    return Request("r", list(range(n_prompt)), SamplingParams(), seed=0)


def test_allocator_never_hands_out_page_zero_and_detects_double_free():
    a = PageAllocator(4, 2)
    pages = a.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4] and a.alloc(1) is None
    a.free(pages[:2])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(pages[:1])
    assert a.num_free_tokens == 4


def test_alloc_extend_fills_pages_then_takes_new_ones():
    kv = _manager(page_size=4)
    req = _req()
    kv.admit(req)
    slots = kv.alloc_extend(req, 6)
    req.kv_len = 6
    pages = slots // 4
    assert len(set(pages[:4].tolist())) == 1 and pages[4] == pages[5] != pages[0]
    assert (slots % 4).tolist() == [0, 1, 2, 3, 0, 1]
    more = kv.alloc_extend(req, 3)  # positions 6, 7 stay on the second page, 8 opens a third
    req.kv_len = 9
    assert more[0] == slots[5] + 1 and more[1] == slots[5] + 2 and more[2] // 4 not in set(pages.tolist())
    kv.check_integrity([req])
    kv.release(req)
    kv.check_integrity([])
    assert kv.allocator.num_free_pages == 8


def test_alloc_extend_refuses_without_side_effects_when_full():
    kv = _manager(num_pages=2, page_size=4)
    req = _req()
    kv.admit(req)
    assert kv.alloc_extend(req, 9) is None
    assert kv.allocator.num_free_pages == 2


def test_integrity_check_catches_a_leak():
    kv = _manager()
    req = _req()
    kv.admit(req)
    kv.alloc_extend(req, 4)
    req.kv_len = 4
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity([])  # the request's page is neither free, running, nor cached


def test_table_rows_are_recycled():
    t = ReqToTokenTable(2, 8)
    r0, r1 = t.alloc_row(), t.alloc_row()
    with pytest.raises(RuntimeError):
        t.alloc_row()
    t.free_row(r0)
    assert t.alloc_row() == r0
    t.write(r1, 2, np.array([7, 8]))
    assert t.slots(r1, 2, 4).tolist() == [7, 8]


def test_backend_resolution_respects_head_size():
    import torch

    from rollout_engine.attention.base import AttentionShape, resolve_backend_name

    def shape(head_dim, device="cuda", dtype=torch.bfloat16):
        return AttentionShape(8, 2, head_dim, 1, dtype, torch.device(device))

    assert resolve_backend_name("auto", shape(16, "cpu")) == "torch"
    assert resolve_backend_name("auto", shape(16)) == "torch"  # FlashInfer has no kernels for 16
    assert resolve_backend_name("auto", shape(128, dtype=torch.float32)) == "torch"
    with pytest.raises(ValueError, match="head_dim"):
        resolve_backend_name("flashinfer", shape(16))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        resolve_backend_name("triton", shape(96))
    assert resolve_backend_name("triton", shape(64)) == "triton"


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_decode_takes_what_one_slot_per_request_takes(page_size):
    """The batched decode allocation gives each request the slot a one-token
    extend would give it (its last page's next slot, or a fresh page), writes
    the same table cells, reports them for the device mirror, and takes
    nothing when too few pages are free."""
    def setup():
        kv = _manager(num_pages=40, page_size=page_size)
        kv.table.track_writes()
        reqs = [_req(n) for n in (3, 4, 5, 8)]
        for r in reqs:
            kv.admit(r)
            kv.alloc_extend(r, len(r.all_ids))
            r.kv_len = len(r.all_ids)
        kv.table.drain_writes()
        return kv, reqs

    one, reqs_one = setup()
    each = np.concatenate([one.alloc_extend(r, 1) for r in reqs_one])
    many, reqs_many = setup()
    batched = many.alloc_decode(reqs_many)
    assert batched.tolist() == each.tolist()
    assert (many.table.table == one.table.table).all()
    assert many.allocator.num_free_pages == one.allocator.num_free_pages
    drained = many.table.drain_writes()
    assert sorted(map(tuple, drained.T.tolist())) == sorted(map(tuple, one.table.drain_writes().T.tolist()))
    for r in reqs_many:
        r.kv_len += 1
    many.check_integrity(reqs_many)

    full, reqs_full = setup()
    full.allocator.alloc(full.allocator.num_free_pages)
    table_before = full.table.table.copy()
    needs_page = any(r.kv_len % page_size == 0 for r in reqs_full)
    assert needs_page and full.alloc_decode(reqs_full) is None
    assert (full.table.table == table_before).all() and full.table.drain_writes() is None
