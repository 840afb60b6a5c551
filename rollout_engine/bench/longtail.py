"""`bench --workload longtail`: the long tail of RL rollouts (docs/benchmarks.md).
Every sample has its own length, so the batch drains: the last, longest
samples run nearly alone while the GPU idles. Reports the makespan, output
tokens/s over time, and the share of wall time with fewer than 32 requests
running (sampled from `engine.metrics()` while the run goes on)."""
from __future__ import annotations

import threading
import time
from typing import Any

from rollout_engine.bench import workloads
from rollout_engine.bench.common import free_device_memory, make_engine, show_progress, sync

LOW_OCCUPANCY = 32
SAMPLE_EVERY_S = 0.1
WINDOWS = 20  # tokens/s over time: this many equal slices of the makespan


class _Sampler:
    """(seconds since start, running, waiting, output tokens so far), polled
    on a thread of its own."""

    def __init__(self, engine):
        self.engine, self.rows = engine, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="longtail-sampler", daemon=True)

    def _run(self) -> None:
        base = self.engine.metrics()["output_tokens"]
        while not self.stop.is_set():
            m = self.engine.metrics()
            self.rows.append((time.perf_counter() - self.start, m["running_requests"], m["waiting_requests"],
                              m["output_tokens"] - base))
            self.stop.wait(SAMPLE_EVERY_S)

    def __enter__(self):
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def summarize(rows: list[tuple[float, int, int, int]], makespan: float, out_tokens: int) -> dict[str, Any]:
    """The figures of one run from its samples (each sample's state holds
    until the next one, the last until the end)."""
    low = 0.0
    if rows and rows[0][0] > 0:  # before the first sample: its state
        rows = [(0.0, *rows[0][1:3], 0)] + rows
    for (t, running, _, _), nxt in zip(rows, rows[1:] + [(makespan, 0, 0, out_tokens)]):
        if running < LOW_OCCUPANCY:
            low += max(0.0, min(nxt[0], makespan) - t)
    edges = [makespan * i / WINDOWS for i in range(WINDOWS + 1)]
    points = [(0.0, 0)] + [(t, tok) for t, _, _, tok in rows] + [(makespan, out_tokens)]

    def tokens_at(t: float) -> float:  # linear between samples
        for (t0, k0), (t1, k1) in zip(points, points[1:]):
            if t0 <= t <= t1:
                return k0 if t1 == t0 else k0 + (k1 - k0) * (t - t0) / (t1 - t0)
        return out_tokens

    def max_running(a: float, b: float) -> int:  # a window without samples keeps the state before it
        inside = [r for t, r, _, _ in rows if a <= t < b]
        before = [r for t, r, _, _ in rows if t < a]
        return max(inside) if inside else before[-1] if before else 0

    rates = [round((tokens_at(b) - tokens_at(a)) / (b - a), 1) for a, b in zip(edges, edges[1:])]
    return {"makespan_s": round(makespan, 3), "output_tokens": out_tokens,
            "output_tok_per_s": round(out_tokens / makespan, 1),
            f"share_of_time_below_{LOW_OCCUPANCY}_running": round(low / makespan, 4),
            "tok_per_s_by_twentieth": rates,
            "max_running_by_twentieth": [max_running(a, b) for a, b in zip(edges, edges[1:])]}


def bench_longtail(args) -> dict[str, Any]:
    engine = make_engine(args)
    try:
        mc = engine.model_config
        wl = workloads.longtail(mc.vocab_size, args.scale, args.n, context=mc.max_position)
        warm = workloads.grpo(engine.model_config.vocab_size, 2, 2, 16, 32, 8, seed=99)
        engine.generate(input_ids=warm.input_ids, sampling_params=warm.params)
        sync()
        with _Sampler(engine) as sampler:
            start = time.perf_counter()
            outs = engine.generate(input_ids=wl.input_ids, sampling_params=wl.params, progress=show_progress())
            sync()
            makespan = time.perf_counter() - start
        out_tokens = sum(len(o.output_token_ids) for o in outs)
        res = summarize(sampler.rows, makespan, out_tokens)
        lens = sorted(p.max_new_tokens for p in wl.params)
        res.update(requests=len(wl.params), prompts=len(set(map(tuple, wl.input_ids))),
                   longest_output=lens[-1], median_output=lens[len(lens) // 2], scale=args.scale)
        return res
    finally:
        free_device_memory(engine)
