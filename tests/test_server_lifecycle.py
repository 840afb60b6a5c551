"""The server as a process: started, refused, stopped (SIGTERM during
requests), loaded by 64 clients, at TP=2, from Python, with routing capture:
each test runs a server of its own (tests/server_procs.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from rollout_engine import RolloutEngine, SamplingParams  # noqa: E402

from server_procs import PROMPTS, START_TIMEOUT, Server, children, free_port, rss  # noqa: E402


@pytest.mark.slow  # a server subprocess of its own; run by .ci/run after the fast tests
def test_api_key_and_sigterm_during_requests(smollm2_dir):
    srv = Server(smollm2_dir, "--api-key", "s3cret")
    try:
        assert httpx.get(srv.url + "/health").status_code == 200  # open
        assert httpx.head(srv.url + "/health").status_code == 200
        assert srv.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}},
                        headers={"Authorization": "bearer s3cret"}).status_code == 200  # the scheme is case-blind
        assert srv.post("/generate", {"text": "a"}).status_code == 401
        assert srv.post("/generate", {"text": "a"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = srv.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}},
                      headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        answers = []

        def slow():
            answers.append(srv.post("/generate", {"text": PROMPTS, "sampling_params": {
                "max_new_tokens": 4000, "ignore_eos": True}}, headers={"Authorization": "Bearer s3cret"}))

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(2)
    finally:
        code, took = srv.stop(timeout=15)
    t.join(10)
    assert code == 0 and took < 5, (code, took, "".join(srv.output)[-2000:])
    assert answers and answers[0].status_code == 200
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in answers[0].json())


@pytest.mark.slow  # a server subprocess of its own; run by .ci/run after the fast tests
def test_serve_refuses_a_busy_port_and_bad_flags_before_loading(smollm2_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, message in ((["--port", str(port)], "cannot listen on"),
                               (["--port", "70000"], "--port: must be in"),
                               (["--host", ""], "--host"), (["--host", "999.1.1.1"], "--host"),
                               (["--api-key", ""], "--api-key"), (["--served-model-name", " "], "--served-model-name"),
                               (["--max-queued-requests", "0"], "--max-queued-requests")):
            out = subprocess.run([sys.executable, "-m", "rollout_engine.cli", "serve", "--model", smollm2_dir, *flags],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 2 and message in out.stderr, (flags, out.stderr[-500:])
            assert "serving" not in out.stdout


@pytest.mark.slow  # a server process of its own; run by .ci/run after the fast tests
def test_the_banner_comes_once_the_port_accepts_connections(tmp_path):
    """`serving ... on http://...` is the signal scripts wait for: a request
    sent the moment it appears is answered (no connection refused). With
    `--log-level info` the server logs a line per request; the banner names
    the --served-model-name."""
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=0), tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rollout_engine.cli", "serve", "--model", folder, "--device", "cpu",
                             "--port", str(port), "--max-total-tokens", "2048", "--log-level", "info",
                             "--served-model-name", "policy"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    banner = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                banner.set()
                # answered now, before this thread reads on
                lines.append(f"health {httpx.get(f'http://127.0.0.1:{port}/health', timeout=5).status_code}\n")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert banner.wait(START_TIMEOUT), "".join(lines)[-2000:]
        deadline = time.monotonic() + 10
        while not any(line.startswith("health") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "health 200\n" in lines, "".join(lines)[-2000:]
        assert f" as policy on http://127.0.0.1:{port}" in next(line for line in lines if "serving" in line)
        deadline = time.monotonic() + 10
        while not any('"GET /health HTTP/1.1" 200' in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any('"GET /health HTTP/1.1" 200' in line for line in lines), "".join(lines)[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()


@pytest.mark.slow  # a server subprocess of its own; run by .ci/run after the fast tests
def test_two_quick_ctrl_cs_stop_the_server_without_a_traceback(tmp_path):
    """A second Ctrl-C while the first shuts the server down (uvicorn then
    cancels what is left) ends it without a traceback (exit 0, or 130 with
    one line when it lands after the server has stopped); a request under
    way is answered with "abort" or its connection closed."""
    from models import make_hf_model, save_model

    srv = Server(save_model(make_hf_model("llama", seed=0, max_position_embeddings=8192), tmp_path), "--device", "cpu")
    answers = []

    def long_request():
        try:
            answers.append(srv.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 6000, "ignore_eos": True}}))
        except httpx.HTTPError as e:  # the second Ctrl-C may close the connection first
            answers.append(e)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.5)
    srv.proc.send_signal(signal.SIGINT)
    time.sleep(0.15)
    srv.proc.send_signal(signal.SIGINT)
    try:
        code = srv.proc.wait(30)
    finally:
        srv.proc.kill()
    t.join(10)
    out = "".join(srv.output)
    # 130 and one line ("interrupted") when the second comes after the server has stopped
    assert code in (0, 130) and "Traceback" not in out and "CancelledError" not in out, (code, out[-3000:])
    assert answers, "the request neither answered nor failed"
    if isinstance(answers[0], httpx.Response):
        assert answers[0].json().get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", answers[0].text


LOAD_REQUESTS = 200


async def _load(url: str, tag: str, requests: int = LOAD_REQUESTS, clients: int = 64) -> tuple[dict, int]:
    """`requests` /generate calls from `clients` concurrent clients; a 503
    must carry Retry-After and is retried. Returns (rid -> answer, 503s)."""
    import asyncio

    answers: dict[str, dict] = {}
    rejected = 0
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def client(http):
        nonlocal rejected
        while not queue.empty():
            i = queue.get_nowait()
            body = {"text": f"Item {i}: the number {i} is", "rid": f"{tag}-{i}",
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            while True:
                r = await http.post(url + "/generate", json=body, timeout=120)
                if r.status_code != 503:
                    break
                rejected += 1
                assert r.headers.get("retry-after") == "1"
                await asyncio.sleep(0.5)  # a real client waits Retry-After; half of it keeps the test short
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["meta_info"]["id"] == body["rid"] and out["meta_info"]["id"] not in answers
            answers[out["meta_info"]["id"]] = out

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return answers, rejected


@pytest.mark.slow  # a load test; run by .ci/run after the fast tests
def test_load_from_64_clients_loses_nothing_and_memory_settles(smollm2_dir):
    import asyncio

    srv = Server(smollm2_dir, "--max-queued-requests", "24", "--max-running-requests", "32")
    try:
        asyncio.run(_load(srv.url, "warm"))
        first, rejected = asyncio.run(_load(srv.url, "first"))
        rss_first = rss(srv.proc.pid)
        second, _ = asyncio.run(_load(srv.url, "second"))
        rss_second = rss(srv.proc.pid)
        assert len(first) == len(second) == LOAD_REQUESTS
        assert rejected > 0  # the bound was reached, and every 503 was retried to success
        # the same prompt gives the same greedy answer under any batching
        assert [first[f"first-{i}"]["output_ids"] for i in range(LOAD_REQUESTS)] == \
            [second[f"second-{i}"]["output_ids"] for i in range(LOAD_REQUESTS)]
        assert rss_second <= 1.1 * rss_first, (rss_first, rss_second)
        assert httpx.get(srv.url + "/get_server_info").json()["admitted_samples"] == 0
        assert srv.post("/flush_cache").json()["success"]
        metrics = httpx.get(srv.url + "/metrics").text
        assert "rollout_engine_kv_usage_ratio 0.0" in metrics  # every page came back
        assert "rollout_engine_running_requests 0.0" in metrics

        # 64 streams dropped midway: all their KV comes back
        async def drop_streams():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as http:
                async def one(i):
                    body = {"text": f"Story {i}:", "stream": True,
                            "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True}}
                    async with http.stream("POST", srv.url + "/generate", json=body, timeout=120) as r:
                        if r.status_code != 200:
                            return
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                return
                await asyncio.gather(*(one(i) for i in range(64)))

        asyncio.run(drop_streams())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            srv.post("/flush_cache")
            metrics = httpx.get(srv.url + "/metrics").text
            if "rollout_engine_kv_usage_ratio 0.0" in metrics and \
                    httpx.get(srv.url + "/get_server_info").json()["admitted_samples"] == 0:
                break
            time.sleep(0.3)
        assert "rollout_engine_kv_usage_ratio 0.0" in metrics
        assert "rollout_engine_running_requests 0.0" in metrics
        # SIGTERM in the middle of a load: exit 0 within 5 s; every answer that came is whole
        results = []

        def load_until_gone():
            try:
                results.append(asyncio.run(_load(srv.url, "term", requests=200)))
            except Exception as e:  # noqa: BLE001 - the server went away mid-load
                results.append(e)

        loader = threading.Thread(target=load_until_gone)
        loader.start()
        time.sleep(3)
    finally:
        code, took = srv.stop(timeout=15)
    assert code == 0 and took < 5, (code, took)
    loader.join(60)
    assert results and not loader.is_alive()


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_a_tp2_server_answers_and_leaves_no_worker_behind(tmp_path):
    from models import make_hf_model, save_model

    hf = make_hf_model("qwen2", seed=3)
    folder = save_model(hf, tmp_path / "tiny")
    srv = Server(folder, "--tp", "2", "--device", "cpu")
    try:
        ids = [[5, 6, 7, 8], [9, 10, 11]]
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        got = srv.post("/generate", {"input_ids": ids, "sampling_params": params}).json()
        ref = RolloutEngine(folder, device="cpu", max_total_tokens=2048).generate(
            input_ids=ids, sampling_params=SamplingParams(**params))
        assert [g["output_ids"] for g in got] == [r.output_token_ids for r in ref]
        workers = children(srv.proc.pid)
        assert workers, "the TP=2 server has no worker process"
    finally:
        code, took = srv.stop(timeout=30)
    assert code == 0, (code, "".join(srv.output)[-2000:])
    time.sleep(1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and
                open(f"/proc/{w}/stat").read().split()[2] != "Z"], "a TP worker outlived the server"


def _healthy(port: int) -> str:
    """The URL of the server starting on `port`, once /health answers 200 (a minute at most)."""
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.25)
    return url


def test_serve_from_python_with_engine_kwargs(tmp_path):
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=4), tmp_path / "tiny")
    port = free_port()
    code = (f"from rollout_engine.server import serve\n"
            f"serve({{'model': {folder!r}, 'device': 'cpu', 'max_total_tokens': 1024}}, port={port}, "
            f"max_queued_requests=8)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _healthy(port)
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        assert httpx.get(url + "/get_server_info").json()["server"]["max_queued_requests"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_serve_on_port_0_tells_ready_the_port_it_got(tmp_path):
    """serve(port=0) in a process of its own: `ready` gets the URL of the
    port the system picked, which answers."""
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=4), tmp_path / "tiny")
    code = ("import os, signal, sys, threading, httpx\n"
            "from rollout_engine.server import serve\n"
            "def check(url):\n"
            "    try:\n"
            "        print(url, httpx.get(url + '/health', timeout=30).status_code, flush=True)\n"
            "    finally:\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "serve({'model': %r, 'device': 'cpu', 'max_total_tokens': 1024}, port=0,\n"
            "      ready=lambda url: threading.Thread(target=check, args=(url,)).start())\n" % folder)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_TIMEOUT + 60)
    url, status = proc.stdout.split()[:2]
    assert proc.returncode == 0 and status == "200", proc.stdout + proc.stderr
    assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > 0, url


@pytest.mark.slow  # two server processes; run by .ci/run after the fast tests
def test_routed_experts_come_base64_encoded_as_sglang_clients_decode_them(tmp_path):
    """`return_routed_experts`: meta_info["routed_experts"] is base64 of an
    int32 array reshaped (-1, moe_layers, top_k), equal to the in-process
    routing; streams carry it on their last chunk."""
    import base64

    import numpy as np

    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("qwen3_moe", seed=5), tmp_path / "moe")
    ids = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=2048, enable_return_routed_experts=True)
    ref = engine.generate(input_ids=ids, sampling_params=SamplingParams(**params, return_routed_experts=True))
    engine.shutdown()
    layers, top_k = ref[0].routed_experts.shape[1:]

    def decode(meta: dict) -> np.ndarray:
        return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, layers, top_k)

    srv = Server(folder, "--device", "cpu", "--enable-return-routed-experts")
    try:
        got = srv.post("/generate", {"input_ids": ids, "sampling_params": params,
                                     "return_routed_experts": True}).json()
        for g, r in zip(got, ref):
            assert np.array_equal(decode(g["meta_info"]), r.routed_experts)
        plain = srv.post("/generate", {"input_ids": ids[0], "sampling_params": params}).json()
        assert "routed_experts" not in plain["meta_info"]
        chunks = []
        with httpx.stream("POST", srv.url + "/generate", timeout=60, json={
                "input_ids": ids[0], "stream": True, "sampling_params": params, "return_routed_experts": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert np.array_equal(decode(chunks[-1]["meta_info"]), ref[0].routed_experts)
        assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
        bad = srv.post("/generate", {"input_ids": ids[0], "return_routed_experts": "yes"})
        assert bad.status_code == 400 and "return_routed_experts" in bad.text
    finally:
        srv.stop()
    srv = Server(folder, "--device", "cpu")  # built without the flag: the request is refused naming it
    try:
        bad = srv.post("/generate", {"input_ids": ids[0], "return_routed_experts": True})
        assert bad.status_code == 400 and "--enable-return-routed-experts" in bad.text, bad.text
        assert bad.json()["error"]["param"] == "return_routed_experts"
    finally:
        srv.stop()


def test_a_request_may_name_the_served_model_or_the_model_argument():
    """The OpenAI routes take either name; another is a 404 that names both."""
    from types import SimpleNamespace

    from rollout_engine.server.errors import ApiError
    from rollout_engine.server.openai_api import _check_model

    st = SimpleNamespace(model_name="policy", engine=SimpleNamespace(config=SimpleNamespace(model="smollm2-135m")))
    _check_model(st, "policy")
    _check_model(st, "smollm2-135m")
    with pytest.raises(ApiError) as err:
        _check_model(st, "other")
    assert err.value.status == 404 and "serves 'policy' (or 'smollm2-135m')" in str(err.value)
    st.model_name = "smollm2-135m"
    with pytest.raises(ApiError) as err:
        _check_model(st, "other")
    assert "(or" not in str(err.value)


@pytest.mark.slow  # a server subprocess of its own; run by .ci/run after the fast tests
def test_a_stop_that_waits_for_a_long_step_says_so_and_a_second_ctrl_c_does_not_stack_another_wait(tmp_path):
    """The abort a Ctrl-C asks for is applied after the step in flight; a
    step that lasts (here the abort is slowed to 3 s, as a long prompt's
    step on a CPU) gets a line saying the server is stopping, a second
    Ctrl-C repeats it instead of waiting for a second abort, and the
    request under way still gets its "abort" answer."""
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=4, max_position_embeddings=8192), tmp_path / "tiny")
    port = free_port()
    code = ("import time\n"
            "from rollout_engine import RolloutEngine\n"
            "from rollout_engine.server import serve\n"
            "real = RolloutEngine.abort\n"
            "calls = []\n"
            "def slow(self, *a):\n"
            "    calls.append(1); print('abort call', len(calls), flush=True); time.sleep(3); return real(self, *a)\n"
            "RolloutEngine.abort = slow\n"
            f"serve({{'model': {folder!r}, 'device': 'cpu', 'max_total_tokens': 8192}}, port={port})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    answers = []
    try:
        url = _healthy(port)
        t = threading.Thread(target=lambda: answers.append(httpx.post(url + "/generate", timeout=60, json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}})))
        t.start()  # about 2,500 tokens come before the slowed abort lands here
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.8)  # past the note's second, inside the slowed abort
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        t.join(10)
    finally:
        proc.kill()
    from rollout_engine.server import STOPPING

    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert out.count(STOPPING) == 2 and out.count("abort call") == 1, out[-3000:]
    assert answers and answers[0].json()["meta_info"]["finish_reason"]["type"] == "abort", answers[0].text
