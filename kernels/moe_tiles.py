"""The fused MoE's Triton kernels (kernels/moe.py calls them): the gate/up
product with SiLU * up, the down product (with the slot sum inside it for
one token), and the slot sum. A block of pairs, all of one expert, times a
column tile of the expert's weights per program; an expert's last block
runs a half or a quarter of its rows where its real pairs fit there
(`_tails`, MoeLaunch.tails). Weights in e4m3 (fp8 experts) are read as
such and scaled after their products (SCALED)."""
from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernels
    import triton
    import triton.language as tl

    from rollout_engine.kernels.moe_route import top_k_rows
    from rollout_engine.kernels.row_parts import row_input

    @triton.jit
    def _tile(pid, NB, tiles, GROUP: tl.constexpr):
        """Program pid's (block, column tile): GROUP blocks in a row take
        column tile 0, then tile 1, ... (a weight tile read for them together)."""
        width = GROUP * tiles
        first = (pid // width) * GROUP
        size = tl.minimum(NB - first, GROUP)
        return first + (pid % width) % size, (pid % width) // size

    @triton.jit
    def _block_rows(sorted_ptr, block_expert_ptr, block, P, BLOCK_M: tl.constexpr, ONE: tl.constexpr = False,
                    ROWS: tl.constexpr = 0):
        """A block's pair ids (int32), which are real pairs, and its expert
        (int64); its first ROWS rows only, where ROWS is set (a tail). ONE
        (one token: `_fused_moe_one`): block j is pair j alone in its first
        row, its expert ids[j] (block_expert_ptr holds the ids)."""
        r = tl.arange(0, BLOCK_M if ROWS == 0 else ROWS)
        if ONE:
            pair = tl.where(r == 0, block, P).to(tl.int32)
        else:
            pair = tl.load(sorted_ptr + block * BLOCK_M + r).to(tl.int32)
        return pair, pair < P, tl.load(block_expert_ptr + block).to(tl.int64)

    @triton.jit
    def _tails(sorted_ptr, block, P, BLOCK_M: tl.constexpr):
        """Whether a block's real pairs reach past its first half, and past
        its first quarter (the align pads an expert's run at its end, so row
        r of a block is real exactly when r < the block's count of pairs)."""
        base = sorted_ptr + block * BLOCK_M
        return tl.load(base + BLOCK_M // 2) < P, tl.load(base + BLOCK_M // 4) < P

    @triton.jit
    def _weight_tile(wd, e, row, col, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows [row, row + BLOCK_N) and columns [col, col + BLOCK_K) of expert
        e's weight through a tensor descriptor over the weights [E, N, K]
        (the copy engine's load, staged in shared memory): zeros past N and
        K; a gate tile past I reads up rows, whose columns are not stored."""
        return wd.load([e.to(tl.int32), row, col]).reshape([BLOCK_N, BLOCK_K])

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        """acc += a b^T; b (a weight tile) taken in a's dtype (e4m3 weights:
        exactly, as every e4m3 value is a bf16 one)."""
        b = b.to(a.dtype)
        if IEEE:
            return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit(do_not_specialize=["P", "NB"])
    def moe_up_kernel(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, NB, H, I,
                      stride_x, stride_we, stride_wn, TOPK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                      IEEE: tl.constexpr, ONE: tl.constexpr = False, COUNTS: tl.constexpr = 1,
                      TAILS: tl.constexpr = False, TMA: tl.constexpr = False, SCALED: tl.constexpr = False,
                      PDL: tl.constexpr = False):
        """One block of sorted pairs and one column tile of I: gate and up
        tiles over K = H, act = silu(gate) * up. ONE: `_block_rows`, and
        program 0 zeroes the down launch's COUNTS tile counters (total_ptr).
        TAILS: a block of few real pairs runs fewer rows (`_tails`). TMA:
        the weight tiles through wd (`gate_up_tile`). SCALED: e4m3 weights,
        their rows' multipliers at s_ptr [E, 2I] (`gate_up_tile`).
        PDL (here and in the other MoE kernels): launched early, it waits
        first (the experts it reads depend on the routing before it)."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        block, nt = _tile(tl.program_id(0), NB, tl.cdiv(I, BLOCK_N), GROUP)
        if ONE:
            if tl.program_id(0) == 0:
                tl.store(total_ptr + tl.arange(0, COUNTS), tl.zeros([COUNTS], tl.int32))
        else:
            if block * BLOCK_M >= tl.load(total_ptr):
                return
        if TAILS:  # a block of few real pairs runs a half or a quarter of its rows
            past_half, past_quarter = _tails(sorted_ptr, block, P, BLOCK_M)
            if past_half:
                _up_rows(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I, stride_x,
                         stride_we, stride_wn, TOPK, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE, TMA,
                         SCALED)
            elif past_quarter:
                _up_rows(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I, stride_x,
                         stride_we, stride_wn, TOPK, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE,
                         ONE, TMA, SCALED)
            else:
                _up_rows(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I, stride_x,
                         stride_we, stride_wn, TOPK, BLOCK_M, BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE,
                         ONE, TMA, SCALED)
        else:
            _up_rows(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I, stride_x,
                     stride_we, stride_wn, TOPK, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE, TMA,
                     SCALED)

    @triton.jit
    def _up_rows(x_ptr, w_ptr, wd, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I, stride_x,
                 stride_we, stride_wn, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 IEEE: tl.constexpr, ONE: tl.constexpr, TMA: tl.constexpr, SCALED: tl.constexpr):
        """The gate/up product of a block's first ROWS rows."""
        pair, m_ok, e = _block_rows(sorted_ptr, block_expert_ptr, block, P, BLOCK_M, ONE, ROWS)
        gate_up_tile(x_ptr, x_ptr, 1.0, w_ptr, wd, s_ptr, act_ptr, pair, m_ok, e, nt, H, I, stride_x, stride_we,
                     stride_wn, TOPK, ROWS, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, False, TMA, SCALED)

    @triton.jit
    def gate_up_tile(x_ptr, g_ptr, inv, w_ptr, wd, s_ptr, act_ptr, pair, m_ok, e, nt, H, I, stride_x, stride_we,
                     stride_wn, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
                     NORM: tl.constexpr, TMA: tl.constexpr, SCALED: tl.constexpr = False):
        """act[pair] for column tile nt of I: the pairs' rows of x (token pair
        // TOPK; real rows m_ok) times expert e's gate and up rows over K = H,
        then silu(gate) * up. NORM (one token, kernels/moe_row.py): x's row
        0 is RMSNorm'd on the fly (norm weight at g_ptr, `inv` = 1 / rms),
        rounded as the norm kernel rounds it. TMA: the weight tiles come
        through wd, a tensor descriptor over w [E, 2I, H] (`_weight_tile`).
        SCALED: w in e4m3, each row's multiplier at s_ptr [E, 2I]; the sums
        (x as it is times the e4m3 values) are scaled before rounding."""
        rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < I
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_x + rk[None, :]
        g_ptrs = w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        u_ptrs = g_ptrs + I * stride_wn
        dt = act_ptr.dtype.element_ty
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(0, tl.cdiv(H, BLOCK_K)):
            k_ok = (i * BLOCK_K + rk < H)[None, :]
            if NORM:
                row = row_input(x_ptr, x_ptr, g_ptr, i * BLOCK_K + rk, i * BLOCK_K + rk < H, inv, True, False)
                a = tl.where(m_ok[:, None], row.to(dt)[None, :], 0.0).to(dt)
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
            if TMA:
                g = _weight_tile(wd, e, nt * BLOCK_N, i * BLOCK_K, BLOCK_N, BLOCK_K)
                u = _weight_tile(wd, e, I + nt * BLOCK_N, i * BLOCK_K, BLOCK_N, BLOCK_K)
            elif EVEN_K:
                if EVEN_N:
                    g = tl.load(g_ptrs)
                    u = tl.load(u_ptrs)
                else:
                    g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
                    u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
            acc_g = _mma(a, g, acc_g, IEEE=IEEE)
            acc_u = _mma(a, u, acc_u, IEEE=IEEE)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if SCALED:
            s_row = s_ptr + e * (2 * I) + rn
            acc_g = acc_g * tl.load(s_row, mask=n_ok, other=1.0)[None, :]
            acc_u = acc_u * tl.load(s_row + I, mask=n_ok, other=1.0)[None, :]
        gate = acc_g.to(dt).to(tl.float32)  # rounded as the unfused gate_up product is
        up = acc_u.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up  # rounded like F.silu, then the product
        tl.store(act_ptr + pair.to(tl.int64)[:, None] * I + rn[None, :], act.to(dt),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _early_expert(early_ptr, j, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
                      FROM_LOGITS: tl.constexpr):
        """Slot j's expert (int64), from what a kernel two launches back
        wrote: the routing's ids [TOPK], or (FROM_LOGITS) the router's
        logits [E], whose top k `top_k_rows` takes as the gate/up launch
        of kernels/moe_row.py does (the same ids). Read past the L1 cache:
        this step's values, not a line an earlier launch left there."""
        if FROM_LOGITS:
            ee = tl.arange(0, BLOCK_E)
            e_ok = ee < E
            x = tl.load(early_ptr + ee, mask=e_ok, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
            _, idx = top_k_rows(x[None, :], ee, e_ok, TOPK, BLOCK_J, False)
            jj = tl.arange(0, BLOCK_J)
            return tl.sum(tl.where(jj[None, :] == j, idx, 0)).to(tl.int64)
        return tl.load(early_ptr + j, cache_modifier=".cg").to(tl.int64)

    @triton.jit
    def _down_weight(w_ptr, wd, e, nt, i, H, I, stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TMA: tl.constexpr):
        """K block i of column tile nt of expert e's down weight [H, I] (zeros past H and I)."""
        rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = i * BLOCK_K + tl.arange(0, BLOCK_K)
        if TMA:
            return _weight_tile(wd, e, nt * BLOCK_N, i * BLOCK_K, BLOCK_N, BLOCK_K)
        w_ptrs = w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        if not EVEN_K:
            return tl.load(w_ptrs, mask=(rn < H)[:, None] & (rk < I)[None, :], other=0.0)
        if EVEN_N:
            return tl.load(w_ptrs)
        return tl.load(w_ptrs, mask=(rn < H)[:, None], other=0.0)

    @triton.jit
    def _act_block(a_ptrs, m_ok, k_ok, EVEN_K: tl.constexpr):
        """A K block of the pairs' activation rows (zeros past I and for padding rows)."""
        if EVEN_K:
            return tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        return tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)

    @triton.jit(do_not_specialize=["P", "NB"])
    def moe_down_kernel(act_ptr, w_ptr, wd, s_ptr, y_ptr, out_ptr, rw_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                        P, NB, H, I, stride_we, stride_wn, early_ptr, E, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        IEEE: tl.constexpr, ONE: tl.constexpr = False, TAILS: tl.constexpr = False,
                        TMA: tl.constexpr = False, PDL: tl.constexpr = False, EARLY: tl.constexpr = 0,
                        FROM_LOGITS: tl.constexpr = False, TOPK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
                        BLOCK_J: tl.constexpr = 1, SCALED: tl.constexpr = False):
        """One block of sorted pairs and one column tile of H: act @ w2[e]^T
        over K = I, times the routing weight, to y[pair]. TAILS: as the
        gate/up launch. ONE: `_block_rows`, and the slot sum too: total_ptr
        counts the tile's finished slots (zeroed by the gate/up launch), and
        the slot that finishes last adds the tile's rows of y in slot order
        into out, as moe_sum_kernel does.
        TMA: the weight tiles through wd, a tensor descriptor over w [E, H,
        I] (`_weight_tile`). EARLY (1, with ONE): the first weight block is
        read before the dependent-launch wait, its expert from early_ptr
        (`_early_expert`). SCALED: w in e4m3, each row's multiplier at s_ptr
        [E, H] (`_down_rows`)."""
        block, nt = _tile(tl.program_id(0), NB, tl.cdiv(H, BLOCK_N), GROUP)
        w0, e0 = 0.0, 0
        if EARLY:
            e0 = _early_expert(early_ptr, block, E, TOPK, BLOCK_E, BLOCK_J, FROM_LOGITS)
            w0 = _down_weight(w_ptr, wd, e0, nt, 0, H, I, stride_we, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, TMA)
        if PDL:  # launched early: nothing else read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if not ONE:
            if block * BLOCK_M >= tl.load(total_ptr):
                return
        if TAILS:  # a block of few real pairs runs a half or a quarter of its rows
            past_half, past_quarter = _tails(sorted_ptr, block, P, BLOCK_M)
            if past_half:
                _down_rows(act_ptr, w_ptr, wd, s_ptr, y_ptr, rw_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H,
                           I, stride_we, stride_wn, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE,
                           TMA, w0, e0, 0, SCALED)
            elif past_quarter:
                _down_rows(act_ptr, w_ptr, wd, s_ptr, y_ptr, rw_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H,
                           I, stride_we, stride_wn, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE,
                           TMA, w0, e0, 0, SCALED)
            else:
                _down_rows(act_ptr, w_ptr, wd, s_ptr, y_ptr, rw_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H,
                           I, stride_we, stride_wn, BLOCK_M, BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE,
                           TMA, w0, e0, 0, SCALED)
        else:
            _down_rows(act_ptr, w_ptr, wd, s_ptr, y_ptr, rw_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I,
                       stride_we, stride_wn, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, ONE, TMA, w0,
                       e0, EARLY, SCALED)
        if ONE:
            # Every thread's stores before one thread's release; the last slot's acquire before its reads,
            # which skip the L1 cache (other programs wrote those rows).
            rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < H
            tl.debug_barrier()
            if tl.atomic_add(total_ptr + nt, 1, sem="acq_rel", scope="gpu") == NB - 1:
                total = tl.zeros([BLOCK_N], tl.float32)
                for j in range(0, NB):
                    total += tl.load(y_ptr + j * H + rn, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_rows(act_ptr, w_ptr, wd, s_ptr, y_ptr, rw_ptr, sorted_ptr, block_expert_ptr, block, nt, P, H, I,
                   stride_we, stride_wn, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
                   ONE: tl.constexpr, TMA: tl.constexpr, w0, e0, EARLY: tl.constexpr, SCALED: tl.constexpr):
        """The down product of a block's first ROWS rows, times the routing
        weights, to y. EARLY (1): w0 is K block 0's weight tile of expert
        e0, read already (read again where the block's expert is another:
        logits whose top k another build of the routing sums in another
        order could name one). SCALED: e4m3 weights, their rows'
        multipliers at s_ptr [E, H], applied to the sums."""
        pair, m_ok, e = _block_rows(sorted_ptr, block_expert_ptr, block, P, BLOCK_M, ONE, ROWS)
        rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < H
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + pair.to(tl.int64)[:, None] * I + rk[None, :]
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        if EARLY:  # K block 0, the loop's first step with the tile read before the wait
            if e != e0:
                w0 = _down_weight(w_ptr, wd, e, nt, 0, H, I, stride_we, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N,
                                  TMA)
            acc = _mma(_act_block(a_ptrs, m_ok, rk < I, EVEN_K), w0, acc, IEEE=IEEE)
            a_ptrs += BLOCK_K
        for i in range(EARLY, tl.cdiv(I, BLOCK_K)):
            w = _down_weight(w_ptr, wd, e, nt, i, H, I, stride_we, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, TMA)
            acc = _mma(_act_block(a_ptrs, m_ok, i * BLOCK_K + rk < I, EVEN_K), w, acc, IEEE=IEEE)
            a_ptrs += BLOCK_K
        if SCALED:  # e4m3 weights: each output column's row multiplier
            acc = acc * tl.load(s_ptr + e * H + rn, mask=n_ok, other=1.0)[None, :]
        rw = tl.load(rw_ptr + pair, mask=m_ok, other=0.0)
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + rn[None, :], (acc * rw[:, None]).to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def moe_sum_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
        """out[t] = y[t, 0] + y[t, 1] + ... in fp32, in slot order."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = h < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (t * TOPK + j) * H + h, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)
