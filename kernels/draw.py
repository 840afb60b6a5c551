"""Temperature sampling without filters, from the logits, in two small
launches: no [B, V] probability table, no float64 prefix sums over the
vocabulary (the sampler's general path writes both, and at large batches
that is most of the sampling time).

Per row, with m the row's maximum logit (argmax_logsumexp gives it) and T
its temperature, the weights exp((x - m) / T) are those of softmax(x / T)
times a constant. The first launch sums them over each of SPLITS chunks of
the vocabulary; the second finds the chunk where the running sum passes
u * total (u: the row's seeded uniform), scans that chunk in blocks for the
first token where it does (a token of weight 0 never is that token), and
writes the token and its logprob, (x - m) / T - log(total). Where rounding
leaves the target unreached, the chunk's last token of positive weight.

`sample_rows` is the sampler's whole step in those two launches: rows at
temperature 0 keep their greedy token, and a row reports its raw logprob
(x - log-sum-exp of the row) where it asks for raw logprobs or is greedy
(elementwise passes on the device would each be a launch, and on the host a
launch costs a small step's time). A greedy row reads none of its logits
there beyond its token's, so an all-greedy step costs two short launches.

`draw_from_weights` runs the same two launches over a [B, V] table of
weights already computed (the processed probabilities of deterministic
mode's sampler): the token only, in place of a float64 prefix sum of the
table and a binary search. A row's chunks are fixed by V alone, so its
token does not depend on the other rows.
"""
from __future__ import annotations

import functools

import torch

SPLITS = 32
BLOCK = 1024


def draw_ref(logits: torch.Tensor, temps: torch.Tensor, row_max: torch.Tensor, greedy: torch.Tensor,
             uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' result computed with torch ops (float64 prefix sums):
    tokens [B] int64 and their logprobs [B] float32 at temperature `temps`."""
    w = torch.exp((logits - row_max[:, None]) / temps[:, None])
    cum = w.double().cumsum(-1)
    total = cum[:, -1]
    target = uniforms.double() * total
    idx = torch.searchsorted(cum, target[:, None], right=True).squeeze(1)
    vocab = logits.shape[-1]
    last = vocab - 1 - (w > 0).flip(-1).int().argmax(-1)  # the last token of positive weight
    tokens = torch.where(idx < vocab, idx, torch.where(w.gather(-1, last[:, None]).squeeze(1) > 0, last, greedy))
    x = logits.gather(-1, tokens[:, None]).squeeze(1)
    return tokens, (x - row_max) / temps - torch.log(total.float())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def weight_of(x_ptr, row, stride, offs, ok, m, inv_t, WEIGHTS: tl.constexpr):
        """exp((x - m) / T) of the logits, or the weights themselves."""
        if WEIGHTS:
            return tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0)
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=float("-inf"))
        return tl.exp((x - m) * inv_t)

    @triton.jit
    def inverse_temperature(t_ptr, row):
        """1 / T, and 1 for a greedy row (T = 0: its weights are not used)."""
        t = tl.load(t_ptr + row)
        return tl.where(t > 0, 1.0 / t, 1.0)

    @triton.jit
    def chunk_sums_kernel(x_ptr, stride, V, CHUNK, m_ptr, t_ptr, s_ptr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                          WEIGHTS: tl.constexpr = False, FINISH: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        m, inv_t = 0.0, 1.0
        if not WEIGHTS:
            m = tl.load(m_ptr + row)
            inv_t = inverse_temperature(t_ptr, row)
        lo = part * CHUNK
        end = V
        if FINISH:  # a greedy row's weights are not used: no reads (its sums are 0)
            end = tl.where(tl.load(t_ptr + row) > 0, V, 0)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, CHUNK, BLOCK):
            local = start + tl.arange(0, BLOCK)
            offs = lo + local
            acc += weight_of(x_ptr, row, stride, offs, (offs < end) & (local < CHUNK), m, inv_t, WEIGHTS=WEIGHTS)
        tl.store(s_ptr + row * SPLITS + part, tl.sum(acc, axis=0))

    @triton.jit
    def pick_kernel(x_ptr, stride, V, CHUNK, m_ptr, t_ptr, s_ptr, u_ptr, g_ptr, tok_ptr, lp_ptr, norm_ptr, raw_ptr,
                    SPLITS: tl.constexpr, BLOCK: tl.constexpr, WEIGHTS: tl.constexpr = False,
                    FINISH: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        m, inv_t = 0.0, 1.0
        if not WEIGHTS:
            m = tl.load(m_ptr + row)
            inv_t = inverse_temperature(t_ptr, row)
        p = tl.arange(0, SPLITS)
        sums = tl.load(s_ptr + row * SPLITS + p)
        total = tl.sum(sums, axis=0)
        target = tl.load(u_ptr + row).to(tl.float32) * total
        cum = tl.cumsum(sums, axis=0)
        # The first chunk whose running sum passes the target (the last one
        # if rounding leaves it unpassed).
        part = tl.minimum(tl.min(tl.where(cum > target, p, SPLITS), axis=0), SPLITS - 1)
        before = tl.sum(tl.where(p < part, sums, 0.0), axis=0)
        lo = part * CHUNK
        found = V
        last = -1  # the chunk's last token of positive weight
        carry = before
        end = V
        if FINISH:  # a greedy row keeps its argmax: no scan
            end = tl.where(tl.load(t_ptr + row) > 0, V, 0)
        for start in range(0, CHUNK, BLOCK):
            local = start + tl.arange(0, BLOCK)
            offs = lo + local
            ok = (offs < end) & (local < CHUNK)
            w = weight_of(x_ptr, row, stride, offs, ok, m, inv_t, WEIGHTS=WEIGHTS)
            c = tl.cumsum(w, axis=0) + carry
            found = tl.minimum(found, tl.min(tl.where(ok & (c > target), offs, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(ok & (w > 0), offs, -1), axis=0))
            carry = tl.max(c, axis=0)  # the running sum after this block (weights >= 0)
        # Summed in another order than the chunk sums, the scan may end a
        # rounding short of the target: then the chunk's last positive token.
        greedy = tl.load(g_ptr + row).to(tl.int32)
        tok = tl.where(found < V, found, tl.where(last >= 0, last, greedy))
        if FINISH:  # greedy rows keep their argmax; raw and greedy rows report the raw logprob
            sampling = tl.load(t_ptr + row) > 0
            tok = tl.where(sampling, tok, greedy)
            x_tok = tl.load(x_ptr + row * stride + tok)
            raw = (tl.load(raw_ptr + row) != 0) | (tl.load(t_ptr + row) <= 0)
            lp = tl.where(raw, x_tok - tl.load(norm_ptr + row), (x_tok - m) * inv_t - tl.log(total))
            tl.store(lp_ptr + row, lp)
        elif not WEIGHTS:
            x_tok = tl.load(x_ptr + row * stride + tok)
            tl.store(lp_ptr + row, (x_tok - m) * inv_t - tl.log(total))
        tl.store(tok_ptr + row, tok.to(tl.int64))

    return chunk_sums_kernel, pick_kernel


def _launch(x: torch.Tensor, temps, row_max, greedy, uniforms, tokens, logprobs, weights: bool,
            log_norm: torch.Tensor | None = None, raw: torch.Tensor | None = None) -> None:
    """`log_norm` and `raw` given: the pick finishes the sampler's step (`sample_rows`)."""
    rows, vocab = x.shape
    chunk = -(-vocab // SPLITS)
    sums = torch.empty((rows, SPLITS), dtype=torch.float32, device=x.device)
    chunk_sums, pick = _kernels()
    finish = log_norm is not None
    chunk_sums[(rows, SPLITS)](x, x.stride(0), vocab, chunk, row_max, temps, sums, SPLITS=SPLITS, BLOCK=BLOCK,
                               WEIGHTS=weights, FINISH=finish)
    pick[(rows,)](x, x.stride(0), vocab, chunk, row_max, temps, sums, uniforms, greedy, tokens, logprobs,
                  log_norm if finish else row_max, raw if finish else greedy,
                  SPLITS=SPLITS, BLOCK=BLOCK, WEIGHTS=weights, FINISH=finish)


def draw(logits: torch.Tensor, temps: torch.Tensor, row_max: torch.Tensor, greedy: torch.Tensor,
         uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 (unit stride in a row); temps [B] float32 > 0;
    row_max [B] float32 and greedy [B] int64 from argmax_logsumexp;
    uniforms [B] float64 in (0, 1). Returns (tokens int64, logprobs float32)."""
    return _draw_rows(logits, temps, row_max, greedy, uniforms)


def _draw_rows(logits, temps, row_max, greedy, uniforms, **finish) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows:
        _launch(logits, temps, row_max, greedy, uniforms, tokens, logprobs, weights=False, **finish)
    return tokens, logprobs


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, row_max: torch.Tensor, log_norm: torch.Tensor,
                greedy: torch.Tensor, uniforms: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw`, with rows at temperature 0 (temps may be 0 there) keeping
    their greedy token, and each row's logprob in its mode: the raw
    x - log_norm where `raw` [B] bool (or uint8) is set or the row is
    greedy, else the processed one. log_norm [B] float32 from
    argmax_logsumexp. The same bits as `draw` at max(T, 1) followed by the
    torch selections (`sample_rows_ref`)."""
    return _draw_rows(logits, temps, row_max, greedy, uniforms, log_norm=log_norm,
                      raw=raw.view(torch.uint8) if raw.dtype == torch.bool else raw)


def sample_rows_ref(logits, temps, row_max, log_norm, greedy, uniforms, raw,
                    draw_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` as a draw and torch selections (`draw_fn`: `draw`, or
    `draw_ref` off the GPU)."""
    sampling = temps > 0
    drawn, processed = (draw_fn or draw)(logits, torch.where(sampling, temps, torch.ones_like(temps)), row_max,
                                         greedy, uniforms)
    tokens = torch.where(sampling, drawn, greedy)
    raw_lp = logits.gather(-1, tokens[:, None]).squeeze(1) - log_norm
    return tokens, torch.where(raw.bool() | ~sampling, raw_lp, processed)


def draw_from_weights(weights: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """weights [B, V] float32 >= 0 (unit stride in a row), uniforms [B]
    float64 in (0, 1), greedy [B] int64 (the token of a row whose weights
    are all 0). Returns tokens int64: per row the first token where the
    running sum of the weights passes u * total (never a token of weight 0)."""
    rows, vocab = weights.shape
    assert weights.dtype == torch.float32 and weights.stride(1) == 1
    tokens = torch.empty(rows, dtype=torch.int64, device=weights.device)
    if rows:
        _launch(weights, weights, weights, greedy, uniforms, tokens, tokens, weights=True)
    return tokens
