"""The pieces that one-row products (batch-1 decode) share: the product's
input normalised inside the kernel, weight rows taken in pairs, and what a
program does with its finished rows (store them; rotate q and k and store
K/V; SiLU(gate) * up). `kernels.gemv` (bf16 / fp16 weights, CUDA cores)
and `kernels.fp8_row` (e4m3 weights, tensor cores) build their kernels from
them, so both round as the unfused kernels round (`kernels.rmsnorm`,
`kernels.rope`, `kernels.activation`)."""
from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is not None:  # module level: kernels in other modules call these
    import triton
    import triton.language as tl

    from rollout_engine.kernels.e4m3 import kv_value

    @triton.jit
    def row_inv_rms(x_ptr, r_ptr, r_out_ptr, K, eps, pid, HAS_RES: tl.constexpr, K_P2: tl.constexpr):
        """1 / rms of the row x (+ r), the sum taken over the whole row at
        once; with HAS_RES program 0 writes x + r (the new residual stream)
        to r_out."""
        kk = tl.arange(0, K_P2)
        row = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        if HAS_RES:
            row = (row.to(tl.float32) + tl.load(r_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(row.dtype)
            if pid == 0:
                tl.store(r_out_ptr + kk, row, mask=kk < K)
        rf = row.to(tl.float32)
        return tl.rsqrt(tl.sum(rf * rf, axis=0) / K + eps)

    @triton.jit
    def row_input(x_ptr, r_ptr, g_ptr, k, k_mask, inv, NORM: tl.constexpr, HAS_RES: tl.constexpr):
        """A block of the product's input in fp32: x, or with NORM the RMSNorm of
        x (+ the residual), rounded as the RMSNorm kernel rounds (`inv`: 1 / rms)."""
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        if NORM:
            dt = x.dtype
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(r_ptr + k, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
            g = tl.load(g_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * inv).to(dt).to(tl.float32) * g).to(dt)
        return x.to(tl.float32)

    @triton.jit
    def paired_rows(pid, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr, HALF: tl.constexpr):
        """The weight rows of program `pid`: BLOCK_N in a row; PAIRED, BLOCK_N / 2
        rows of the first half of a segment of 2 * HALF rows (a head for the
        rotary embedding, the whole gate_up weight for SiLU * mul) and the
        rows HALF after them (the other element of each pair)."""
        i = tl.arange(0, BLOCK_N)
        if PAIRED:
            pairs: tl.constexpr = BLOCK_N // 2
            head = pid // (HALF // pairs)
            return head * 2 * HALF + (pid % (HALF // pairs)) * pairs + i % pairs + (i // pairs) * HALF
        return pid * BLOCK_N + i

    @triton.jit
    def _pairs(y, dt, BLOCK_N: tl.constexpr):
        """The two elements of each pair of `paired_rows` (first halves, second
        halves), rounded to dt as the product's output would be."""
        halves = tl.reshape(y.to(dt).to(tl.float32), (2, BLOCK_N // 2))
        first = tl.arange(0, 2)[:, None] == 0
        return tl.sum(tl.where(first, halves, 0.0), axis=0), tl.sum(tl.where(first, 0.0, halves), axis=0)

    @triton.jit
    def _rotate_and_store(y, pid, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                          BLOCK_N: tl.constexpr, HALF: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr):
        """Rotary pairs of one head (see `paired_rows`), rounded as `kernels.rope`
        rounds: q to y, k and v to the caches at the token's slot."""
        pairs: tl.constexpr = BLOCK_N // 2
        dt = y_ptr.dtype.element_ty
        y1, y2 = _pairs(y, dt, BLOCK_N)
        head = pid // (HALF // pairs)
        j = (pid % (HALF // pairs)) * pairs + tl.arange(0, pairs)
        if head < NQ + NK:
            pos = tl.load(pos_ptr)
            c = tl.load(cos_ptr + pos * cs_stride + j).to(dt).to(tl.float32)
            s = tl.load(sin_ptr + pos * cs_stride + j).to(dt).to(tl.float32)
            r1 = y1 * c - y2 * s
            r2 = y2 * c + y1 * s
            if head < NQ:
                q_out = y_ptr + head * 2 * HALF
                tl.store(q_out + j, r1.to(dt))
                tl.store(q_out + HALF + j, r2.to(dt))
            else:  # (a pointer of its own: the caches may hold another type than y)
                k_out = kc_ptr + (tl.load(loc_ptr).to(tl.int64) * NK + head - NQ) * 2 * HALF
                tl.store(k_out + j, kv_value(r1, dt, kc_ptr.dtype.element_ty))
                tl.store(k_out + HALF + j, kv_value(r2, dt, kc_ptr.dtype.element_ty))
        else:
            v_out = vc_ptr + (tl.load(loc_ptr).to(tl.int64) * NK + head - NQ - NK) * 2 * HALF
            tl.store(v_out + j, kv_value(y1, dt, vc_ptr.dtype.element_ty))
            tl.store(v_out + HALF + j, kv_value(y2, dt, vc_ptr.dtype.element_ty))

    @triton.jit
    def finish_rows(y, pid, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                    GATED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, NQ: tl.constexpr,
                    NK: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program `pid`'s finished rows y (fp32, rows n of `paired_rows`):
        stored to y; ROPE (a qkv product, NQ and NK heads of 2 * HALF): q
        rotated into y, k rotated and v written to the caches at the token's
        slot; GATED (W: gate rows then up rows, HALF of each): SiLU(gate) *
        up to y, rounded as `kernels.activation` rounds."""
        if ROPE:
            _rotate_and_store(y, pid, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                              BLOCK_N, HALF, NQ, NK)
        elif GATED:
            dt = y_ptr.dtype.element_ty
            gate, up = _pairs(y, dt, BLOCK_N)
            act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
            pairs: tl.constexpr = BLOCK_N // 2
            tl.store(y_ptr + pid * pairs + tl.arange(0, pairs), (act * up).to(dt))
        else:
            tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)
