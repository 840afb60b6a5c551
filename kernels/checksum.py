"""A checksum of a tensor's bits that tensor-parallel shards can compute
apart and add up: the same digest for the whole tensor and for any split of
it into rectangular blocks, on any device.

The tensor (in the dtype being checked) is seen as 2D, [rows, cols] with
cols the product of the trailing dimensions (a 1-D tensor is one row), and
each row as 32-bit little-endian words (2 bf16/fp16 values, 4 fp8 values;
the last word of a row zero-padded). Word w of row r has the global index
g = r * words_per_row + w, and contributes

    x = mix(word ^ (lo(g) * C1 + hi(g) * C2))         (uint32 arithmetic)
    lane1 += x,  lane2 += x * (2 * lo(g) + 1)          (mod 2**32)

so a changed, swapped or moved value changes the sums, and sums of blocks
add up to the sum of the whole. Not cryptographic: it tells a sync that
went wrong, not an adversary.

One wrapper (`block_sums`), one reference (`block_sums_ref`, numpy); both
return a device tensor [2] of int64 lane sums (mod 2**32), so many tensors
can be checked with one host read at the end."""
from __future__ import annotations

import functools

import numpy as np
import torch

from rollout_engine.kernels._triton import cdiv

M32 = 0xFFFFFFFF
C1, C2, C3, C4 = 0x27D4EB2F, 0x165667B1, 0x7FEB352D, 0x1B873593
BLOCK_WORDS = 2048
ITERS = 8
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def words_per_row(cols: int, itemsize: int) -> int:
    per_word = 4 // itemsize
    return -(-cols // per_word)


def _words(block: np.ndarray, itemsize: int) -> np.ndarray:
    """[rows, cols] raw values (unsigned ints of `itemsize` bytes) -> [rows, words] uint32."""
    per_word, bits = 4 // itemsize, 8 * itemsize
    pad = -block.shape[1] % per_word
    if pad:
        block = np.pad(block, ((0, 0), (0, pad)))
    raw = block.reshape(block.shape[0], -1, per_word).astype(np.uint32)
    words = raw[..., 0].copy()
    for j in range(1, per_word):
        words |= raw[..., j] << np.uint32(bits * j)
    return words


def block_sums_ref(block: torch.Tensor, row_words: int, row0: int, word0: int) -> torch.Tensor:
    """Lane sums of a 2D `block` whose first element is word `word0` of row
    `row0` of a tensor with `row_words` words per row (numpy's wrapping
    uint32 arithmetic, on the host)."""
    size = block.element_size()
    raw = block.detach().cpu().contiguous().view(_INT_OF_SIZE[size]).numpy().view(f"u{size}")
    rows_per_chunk = max(1, (1 << 22) // max(1, raw.shape[1]))
    lanes = np.zeros(2, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for start in range(0, raw.shape[0], rows_per_chunk):
            words = _words(raw[start: start + rows_per_chunk], size)
            r = np.arange(words.shape[0], dtype=np.uint64) + np.uint64(row0 + start)
            w = np.arange(words.shape[1], dtype=np.uint64) + np.uint64(word0)
            g = r[:, None] * np.uint64(row_words) + w[None, :]
            lo, hi = g.astype(np.uint32), (g >> np.uint64(32)).astype(np.uint32)
            x = words ^ (lo * np.uint32(C1) + hi * np.uint32(C2))
            x ^= x >> np.uint32(16)
            x *= np.uint32(C3)
            x ^= x >> np.uint32(15)
            x *= np.uint32(C4)
            x ^= x >> np.uint32(16)
            lanes[0] += x.sum(dtype=np.uint32)
            lanes[1] += (x * (lo * np.uint32(2) + np.uint32(1))).sum(dtype=np.uint32)
    return torch.tensor(lanes.astype(np.int64), device=block.device)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def checksum_kernel(src_ptr, out_ptr, nw, row_stride, row_words, row0, word0,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr):
        row = tl.program_id(0)
        cb = tl.program_id(1)
        acc1 = tl.zeros((BLOCK,), dtype=tl.uint32)
        acc2 = tl.zeros((BLOCK,), dtype=tl.uint32)
        base = src_ptr + row.to(tl.int64) * row_stride
        g_row = (row0 + row).to(tl.int64) * row_words + word0
        for it in tl.static_range(ITERS):
            w = (cb * ITERS + it).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            valid = w < nw
            word = tl.load(base + w, mask=valid, other=0).to(tl.uint32, bitcast=True)
            g = g_row + w
            lo = (g & 0xFFFFFFFF).to(tl.uint32)
            hi = (g >> 32).to(tl.uint32)
            x = word ^ (lo * 0x27D4EB2F + hi * 0x165667B1)
            x = x ^ (x >> 16)
            x = x * 0x7FEB352D
            x = x ^ (x >> 15)
            x = x * 0x1B873593
            x = x ^ (x >> 16)
            x = tl.where(valid, x, 0)
            acc1 += x
            acc2 += x * (2 * lo + 1)
        pid = row * tl.num_programs(1) + cb
        tl.store(out_ptr + 2 * pid, tl.sum(acc1.to(tl.int64), axis=0) & 0xFFFFFFFF)
        tl.store(out_ptr + 2 * pid + 1, tl.sum(acc2.to(tl.int64), axis=0) & 0xFFFFFFFF)

    return checksum_kernel


def _as_words(block: torch.Tensor) -> torch.Tensor | None:
    """`block` reinterpreted as int32 words in place, if its layout allows."""
    if block.element_size() not in _INT_OF_SIZE or block.stride(-1) != 1:
        return None
    per_word = 4 // block.element_size()
    if block.shape[1] % per_word or block.stride(0) % per_word or block.storage_offset() % per_word:
        return None
    try:
        return block.view(_INT_OF_SIZE[block.element_size()]).view(torch.int32)
    except RuntimeError:
        return None


def _plan(block: torch.Tensor, row_words: int):
    """(int32 words, rows, words per row, grid) for the kernel, or None."""
    words = _as_words(block) if block.is_cuda and block.numel() else None
    if words is None:
        return None
    rows, nw = words.shape
    if rows > 1 and words.stride(0) == nw and nw == row_words:  # whole rows, contiguous: one long row
        words, nw, rows = words.reshape(1, -1), rows * nw, 1
    return words, nw, (rows, cdiv(nw, BLOCK_WORDS * ITERS))


def many_sums(blocks) -> torch.Tensor:
    """Lane sums [len(blocks), 2] of (block, row_words, row0, word0) tuples:
    one kernel launch per block into one buffer of partials, added up per
    block by one device op (no per-tensor reductions or host reads)."""
    plans = [_plan(b[0], b[1]) for b in blocks]
    device = blocks[0][0].device if blocks else torch.device("cpu")
    out = torch.zeros(len(blocks), 2, dtype=torch.int64, device=device)
    launched = [(i, p) for i, p in enumerate(plans) if p is not None]
    if launched:
        sizes = [p[2][0] * p[2][1] for _, p in launched]
        partials = torch.empty(sum(sizes), 2, dtype=torch.int64, device=device)
        start = 0
        for (i, (words, nw, grid)), size in zip(launched, sizes):
            _, row_words, row0, word0 = blocks[i]
            _kernel()[grid](words, partials[start:], nw, words.stride(0), row_words, row0, word0,
                            BLOCK=BLOCK_WORDS, ITERS=ITERS, num_warps=8)
            start += size
        owner = torch.repeat_interleave(torch.tensor([i for i, _ in launched], device=device),
                                        torch.tensor(sizes, device=device))
        out.index_add_(0, owner, partials)
    for i, p in enumerate(plans):
        if p is None:
            out[i] = block_sums_ref(*blocks[i]).to(device)
    return out & M32


def block_sums(block: torch.Tensor, row_words: int, row0: int, word0: int) -> torch.Tensor:
    """`block_sums_ref`, on the GPU by the Triton kernel where the block is
    whole words."""
    return many_sums([(block, row_words, row0, word0)])[0]


def digest(sums: tuple[int, int]) -> str:
    return f"{sums[0] & M32:08x}{sums[1] & M32:08x}"


def whole(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A whole tensor (in the dtype being checked) as one block."""
    rows = tensor.shape[0] if tensor.dim() >= 2 else 1
    block = tensor.reshape(rows, -1) if tensor.numel() else tensor.reshape(rows, 0)
    return block, words_per_row(block.shape[1], tensor.element_size()), 0, 0


def tensor_sums(tensor: torch.Tensor) -> torch.Tensor:
    """Lane sums of a whole tensor."""
    return block_sums(*whole(tensor))
