"""`serve` workload: the same requests, at the same concurrency, in process
(`generate_async`) and through the HTTP server (`/generate` over localhost,
the server in this process on the same engine); output tok/s of both.

The offline request mix (random input and output lengths), `--concurrency`
requests in flight at a time, one request per prompt."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

from rollout_engine.bench import workloads
from rollout_engine.bench.common import free_device_memory, make_engine


async def _in_process(engine, wl: workloads.Workload, concurrency: int) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def one(ids, params) -> int:
        async with gate:
            outs = await engine.generate_async(input_ids=[ids], sampling_params=params)
            return len(outs[0].output_token_ids)

    return sum(await asyncio.gather(*(one(i, p) for i, p in zip(wl.input_ids, wl.params))))


async def _over_http(url: str, wl: workloads.Workload, concurrency: int) -> int:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=3600) as http:
        async def one(ids, p) -> int:
            body = {"input_ids": ids, "sampling_params": {
                "max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "ignore_eos": p.ignore_eos}}
            async with gate:
                r = await http.post(url + "/generate", json=body)
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(i, p) for i, p in zip(wl.input_ids, wl.params))))


def _start_server(engine, port: int):
    import uvicorn

    from rollout_engine.server import KEEP_ALIVE_S
    from rollout_engine.server.app import build_app
    from rollout_engine.server.config import ServerConfig

    cfg = ServerConfig(port=port, max_queued_requests=1 << 20)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, cfg), host=cfg.host, port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True, name="bench-server")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the benchmark's server did not start")
        time.sleep(0.05)
    return server, thread


def _timed(coro) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = asyncio.run(coro)
    return tokens, time.perf_counter() - start


def bench_serve(args) -> dict[str, Any]:
    from rollout_engine.distributed.tp_group import free_port

    engine = make_engine(args)
    vocab = engine.model_config.vocab_size
    wl = workloads.offline(vocab, args.num_prompts, in_min=args.prompt_min, in_max=args.prompt_max,
                           out_min=min(100, args.output_len), out_max=args.output_len)
    warm = workloads.offline(vocab, 8, in_max=64, out_max=16, in_min=8, out_min=4, seed=99)
    port = free_port()
    server, thread = _start_server(engine, port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_in_process(engine, warm, args.concurrency))
        asyncio.run(_over_http(url, warm, args.concurrency))
        runs: dict[str, list[tuple[int, float]]] = {"in_process": [], "http": []}
        for _ in range(2):  # alternated, best of two: neither side gets the warmer machine
            runs["in_process"].append(_timed(_in_process(engine, wl, args.concurrency)))
            runs["http"].append(_timed(_over_http(url, wl, args.concurrency)))
        rows = {}
        for name, timings in runs.items():
            tokens, seconds = min(timings, key=lambda t: t[1])
            rows[name] = {"output_tokens": tokens, "seconds": round(seconds, 3),
                          "output_tok_per_s": round(tokens / seconds, 1)}
            print(f"serve {name}: {rows[name]['output_tok_per_s']} output tok/s", file=sys.stderr, flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
        free_device_memory(engine)
    rows["concurrency"] = args.concurrency
    rows["requests"] = len(wl.input_ids)
    rows["http_over_in_process"] = round(rows["http"]["output_tok_per_s"] / rows["in_process"]["output_tok_per_s"], 3)
    return rows
