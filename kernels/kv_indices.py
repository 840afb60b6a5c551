"""Page indices of every sequence in a step, built on the GPU from the device
request table: out[page_indptr[b] + i] = table[rows[b], i * page_size] // page_size.

One wrapper (`build_page_indices`), one torch reference (`build_page_indices_ref`)."""
from __future__ import annotations

import torch


def build_page_indices_ref(table: torch.Tensor, rows: torch.Tensor, page_indptr: torch.Tensor,
                           page_size: int) -> torch.Tensor:
    parts = []
    for b in range(rows.numel()):
        n = int(page_indptr[b + 1] - page_indptr[b])
        parts.append(table[int(rows[b]), : n * page_size: page_size] // page_size)
    return torch.cat(parts).to(torch.int32)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["batch"])  # one compiled kernel for every batch size
    def page_indices_kernel(table_ptr, table_stride, rows_ptr, indptr_ptr, out_ptr, batch,
                            PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(indptr_ptr + b)
        if b < batch:
            row = tl.load(rows_ptr + b).to(tl.int64)
            n = tl.load(indptr_ptr + b + 1) - start
            for i in range(0, n, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                mask = offs < n
                slot = tl.load(table_ptr + row * table_stride + offs.to(tl.int64) * PAGE_SIZE, mask=mask)
                tl.store(out_ptr + start + offs, (slot // PAGE_SIZE).to(tl.int32), mask=mask)
        else:  # a padding sequence: one page, the reserved page 0
            tl.store(out_ptr + start, 0)

    return page_indices_kernel


_KERNEL = None


def build_page_indices(table: torch.Tensor, rows: torch.Tensor, page_indptr: torch.Tensor, page_size: int,
                       total_pages: int, out: torch.Tensor | None = None, pad: int = 0) -> torch.Tensor:
    """table: [R, C] int32/int64 (device); rows: [B]; page_indptr: [B + 1] int32
    (device); total_pages = page_indptr[B], known on the host. Writes into
    `out[:total_pages]` when given. `pad`: padding sequences after the B
    (a captured graph's), one page each, page 0: page_indptr then has
    B + pad + 1 entries, and `out[total_pages: total_pages + pad]` gets zeros
    in the same launch."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    if out is None:
        out = torch.empty(max(total_pages + pad, 1), dtype=torch.int32, device=table.device)
    batch = rows.numel()
    if batch + pad:
        _KERNEL[(batch + pad,)](table, table.stride(0), rows, page_indptr, out, batch, PAGE_SIZE=page_size, BLOCK=512)
    return out[:total_pages + pad]
