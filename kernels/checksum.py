"""A checksum of a tensor's bits that tensor-parallel shards can compute
apart and add up: the same digest for the whole tensor and for any split of
it into rectangular blocks, on any device.

The tensor (in the dtype being checked) is seen as 2D, [rows, cols] with
cols the product of the trailing dimensions (a 1-D tensor is one row), and
each row as 32-bit little-endian words (2 bf16/fp16 values, 4 fp8 values;
the last word of a row zero-padded). Word w of row r has the position
p = (r * words_per_row + w) mod 2**32, and contributes

    x = (word ^ (p * C1)) * C3;  x ^= x >> 16          (uint32 arithmetic)
    lane1 += x,  lane2 += x * (2 * p + 1)               (mod 2**32)

A changed value changes x (each step is a bijection of the word), and a
swapped or moved one changes lane2 (its weight depends on the position), so
the sums tell a sync that went wrong; blocks' sums add up to the whole's.
Not cryptographic: it tells a mistake, not an adversary. The mix is kept
this short because the pass must run at memory speed (about ten integer
operations per word).

One entry point (`SumPlan`: every block of a call in one kernel launch,
found through a table of blocks built once; `many_sums` builds and runs one)
and one reference (`block_sums_ref`,
numpy); both give int64 lane sums (mod 2**32) on the blocks' device, so
many tensors are checked with one host read at the end."""
from __future__ import annotations

import functools

import numpy as np
import torch

from rollout_engine.kernels._triton import cdiv

M32 = 0xFFFFFFFF
C1, C3 = 0x27D4EB2F, 0x7FEB352D
BLOCK_WORDS = 1024
ITERS = 16
NUM_WARPS = 4  # 1024 x 16 words (64 KiB) per program, 4 warps: the fastest of a sweep on an H200
MAX_ROW_WORDS = 1 << 30  # longer rows are hashed in pieces (int32 offsets inside the kernel)
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
            p = (r[:, None] * np.uint64(row_words) + w[None, :]).astype(np.uint32)
            x = (words ^ (p * np.uint32(C1))) * np.uint32(C3)
            x ^= x >> np.uint32(16)
            lanes[0] += x.sum(dtype=np.uint32)
            lanes[1] += (x * (p * np.uint32(2) + np.uint32(1))).sum(dtype=np.uint32)
    return torch.tensor(lanes.astype(np.int64), device=block.device)


# One row of the block table: offset of the block's first word from the base
# tensor (in words), words per row of the block, row stride (in words), rows,
# programs per row, first program, position of the first word (row0 *
# row_words + word0), words per row of the full tensor.


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def checksum_kernel(base_ptr, table_ptr, block_of_ptr, out_ptr,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        entry = table_ptr + tl.load(block_of_ptr + pid).to(tl.int64) * 8
        off, nw, stride = tl.load(entry + 0), tl.load(entry + 1).to(tl.int32), tl.load(entry + 2)
        per_row, first = tl.load(entry + 4), tl.load(entry + 5)
        pos0, row_words = tl.load(entry + 6), tl.load(entry + 7)
        local = pid - first
        row, cb = local // per_row, local % per_row
        start = off + row * stride
        if ALIGNED:  # every block starts on 16 bytes, with whole 16-byte rows: vector loads
            start = tl.multiple_of(start, 4)
            nw = tl.multiple_of(nw, 4)
        base = base_ptr + start
        p0 = ((pos0 + row * row_words) & 0xFFFFFFFF).to(tl.uint32)
        lane = tl.arange(0, BLOCK)
        lane_key = lane.to(tl.uint32) * 0x27D4EB2F  # p * C1 and 2p + 1 as a per-block scalar plus these
        lane_weight = lane.to(tl.uint32) * 2
        acc1 = tl.zeros((BLOCK,), dtype=tl.uint32)
        acc2 = tl.zeros((BLOCK,), dtype=tl.uint32)
        for it in tl.static_range(ITERS):
            w0 = (cb * ITERS + it).to(tl.int32) * BLOCK
            w = w0 + lane
            valid = w < nw
            word = tl.load(base + w, mask=valid, other=0).to(tl.uint32, bitcast=True)
            p = p0 + w0.to(tl.uint32)
            x = (word ^ (p * 0x27D4EB2F + lane_key)) * 0x7FEB352D
            x = x ^ (x >> 16)
            x = tl.where(valid, x, 0)
            acc1 += x
            acc2 += x * (2 * p + 1 + lane_weight)
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


def _pieces(block, row_words: int, row0: int, word0: int):
    """The kernel's (words, rows, words per row, row stride, position of the
    first word, full words per row) for `block`, in pieces whose rows are
    shorter than MAX_ROW_WORDS; None if it cannot be read as words in place."""
    words = _as_words(block) if block.is_cuda and block.numel() else None
    if words is None:
        return None
    rows, nw = words.shape
    stride = words.stride(0) if rows > 1 else nw
    if rows > 1 and stride == nw == row_words:  # whole rows, contiguous: one long row
        rows, nw, stride = 1, rows * nw, rows * nw
    return [(words, rows, min(MAX_ROW_WORDS, nw - s), s, stride, row0 * row_words + word0 + s, row_words)
            for s in range(0, nw, MAX_ROW_WORDS)]


class SumPlan:
    """The device-side tables for hashing a list of (block, row_words, row0,
    word0) tuples, built once (the host work: a few microseconds per block)
    and run any number of times while the blocks stay where they are: the
    GPU blocks in one kernel launch per alignment class (16-byte aligned or
    not); blocks not whole words, or on the CPU, by the reference."""

    def __init__(self, blocks) -> None:
        self.device = blocks[0][0].device if blocks else torch.device("cpu")
        self.count = len(blocks)
        self.by_reference: list[tuple[int, tuple]] = []
        groups = {True: [], False: []}
        for i, (block, row_words, row0, word0) in enumerate(blocks):
            pieces = _pieces(block, row_words, row0, word0)
            if pieces is None:
                self.by_reference.append((i, (block, row_words, row0, word0)))
                continue
            for words, rows, nw, skip, stride, pos0, rw in pieces:
                fits = (words.data_ptr() + 4 * skip) % 16 == 0 and nw % 4 == 0 and (rows == 1 or stride % 4 == 0)
                groups[fits].append((i, words, rows, nw, skip, stride, pos0, rw))
        self.launches = [self._table(group, aligned) for aligned, group in groups.items() if group]

    def _table(self, group, aligned: bool):
        """(base tensor, block table, block of each program, owner of each
        program, programs, aligned) for one launch over `group`, [(owner,
        words, rows, nw, skip, stride, pos0, row_words)]."""
        base, table, owners, counts, first = group[0][1], [], [], [], 0
        for owner, words, rows, nw, skip, stride, pos0, row_words in group:
            per_row = cdiv(nw, BLOCK_WORDS * ITERS)
            off = (words.data_ptr() - base.data_ptr()) // 4 + skip
            table.append((off, nw, stride, rows, per_row, first, pos0, row_words))
            owners.append(owner)
            counts.append(rows * per_row)
            first += rows * per_row
        table_d = torch.tensor(table, dtype=torch.int64).to(self.device)
        counts = torch.tensor(counts).to(self.device)
        block_of = torch.repeat_interleave(torch.arange(len(table), device=self.device, dtype=torch.int32),
                                           counts, output_size=first)
        owner_of = torch.tensor(owners).to(self.device)[block_of.long()]
        return base, table_d, block_of, owner_of, first, aligned

    def run(self) -> torch.Tensor:
        """Lane sums [blocks, 2] (int64, mod 2**32) on the blocks' device."""
        out = torch.zeros(self.count, 2, dtype=torch.int64, device=self.device)
        for i, block in self.by_reference:
            out[i] = block_sums_ref(*block).to(self.device)
        for base, table, block_of, owner_of, programs, aligned in self.launches:
            partials = torch.empty(programs, 2, dtype=torch.int64, device=self.device)
            _kernel()[(programs,)](base, table, block_of, partials, BLOCK=BLOCK_WORDS, ITERS=ITERS,
                                   ALIGNED=aligned, num_warps=NUM_WARPS)
            out.index_add_(0, owner_of, partials)
        return out & M32


def many_sums(blocks) -> torch.Tensor:
    """Lane sums [len(blocks), 2] of (block, row_words, row0, word0) tuples
    (`SumPlan`, built and run once)."""
    return SumPlan(blocks).run()


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
