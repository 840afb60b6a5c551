"""`rollout-engine serve` as a subprocess on a free localhost port, talked to
only through real clients (httpx, the openai package), on SmolLM2."""
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
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from rollout_engine import RolloutEngine, SamplingParams  # noqa: E402

START_TIMEOUT = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rollout_engine.cli", "serve", "--model", model, "--port", str(self.port),
               "--max-total-tokens", "8192", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {''.join(self.output)[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError("the server did not come up")

    def post(self, path: str, body=None, **kw):
        return httpx.post(self.url + path, json=body, timeout=120, **kw)

    def stop(self, timeout: float = 10) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        return code, time.monotonic() - start


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = Server(smollm2_dir, "--max-queued-requests", "64")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def local(smollm2_dir):
    engine = RolloutEngine(smollm2_dir, max_total_tokens=8192)
    yield engine
    engine.shutdown()


PROMPTS = ["The capital of France is", "Two plus two equals", "A short poem about the sea:"]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_native_generate_equals_in_process(server, local):
    body = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY, "return_logprob": True,
                                     "top_logprobs_num": 2}).json()
    ref = local.generate(PROMPTS, sampling_params=SamplingParams(**GREEDY, top_logprobs=2))
    assert len(body) == len(PROMPTS)
    for got, want in zip(body, ref):
        assert got["output_ids"] == want.output_token_ids
        assert got["text"] == want.text
        lps = [triple[0] for triple in got["meta_info"]["output_token_logprobs"]]
        assert [triple[1] for triple in got["meta_info"]["output_token_logprobs"]] == want.output_token_ids
        assert max(abs(a - b) for a, b in zip(lps, want.output_logprobs)) < 1e-5
        assert len(got["meta_info"]["output_top_logprobs"][0]) == 2
        meta = got["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["weight_version"] == 0 and meta["completion_tokens"] == 12
    single = server.post("/generate", {"input_ids": ref[0].prompt_token_ids, "sampling_params": GREEDY}).json()
    assert isinstance(single, dict) and single["output_ids"] == ref[0].output_token_ids


def test_native_stream_ends_with_the_full_output(server):
    events = []
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={"text": PROMPTS[:2], "stream": True, "sampling_params": GREEDY}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    last = {}
    for e in events[:-1]:
        chunk = json.loads(e)
        last[chunk["index"]] = chunk
    whole = server.post("/generate", {"text": PROMPTS[:2], "sampling_params": GREEDY}).json()
    assert [last[i]["output_ids"] for i in range(2)] == [w["output_ids"] for w in whole]
    assert [last[i]["text"] for i in range(2)] == [w["text"] for w in whole]
    # a prompt over the context length: a 400 before the stream starts, or an error event in it; never a 500
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={"input_ids": [5] * 20000, "stream": True, "sampling_params": GREEDY}) as r:
        text = r.read().decode()
    assert r.status_code == 400 or ('"error"' in text and text.rstrip().endswith("data: [DONE]")), text[:300]
    assert server.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).status_code == 200


def test_openai_client_completions_chat_and_streaming(server, local):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, n=2, logprobs=2)
    want = local.generate(PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=12, temperature=0, n=2))
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == sum(len(w.output_token_ids) for w in want)
    assert len(r.choices[0].logprobs.top_logprobs[0]) == 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=1)
    ids = local.apply_chat_template(messages)
    ref = local.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=16, temperature=0))[0]
    assert chat.choices[0].message.content == ref.text
    assert [t.logprob for t in chat.choices[0].logprobs.content] == pytest.approx(ref.output_logprobs, abs=1e-5)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.output_token_ids)
    sampled = [client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                                         seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x", max_tokens=2)
    # SGLang/vLLM extensions are honoured; a field that would not be (a typo, logit_bias) is a 400 naming it
    long = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "top_k": 5})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 40
    for extra, field in (({"temprature": 0}, "temprature"), ({"logit_bias": {"28": -100}}, "logit_bias"),
                         ({"top_k": "5"}, "top_k")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == field, err.value.body
    # curl's default form content type still reads as JSON
    raw = httpx.post(server.url + "/v1/completions", timeout=60,
                     content=json.dumps({"model": model, "prompt": "x", "max_tokens": 2}))
    assert raw.status_code == 200, raw.text


def test_rl_controls(server, tmp_path, smollm2_dir):
    from safetensors.torch import load_file, save_file

    before = server.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    tensors = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    for name in tensors:
        if name.endswith("mlp.down_proj.weight"):
            tensors[name] = tensors[name] * 0.5
    save_file(tensors, str(tmp_path / "model.safetensors"))
    r = server.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert r.status_code == 200 and r.json()["success"]
    from rollout_engine.fidelity import weights_checksum

    name = "model.layers.0.mlp.down_proj.weight"
    sums = httpx.get(server.url + "/weights_checksum", params={"names": [name, "model.norm.weight"]}).json()
    assert sums["weight_version"] == 1 and sums["checksums"] == weights_checksum(
        {n: tensors[n] for n in (name, "model.norm.weight")}, "float32")
    assert len(httpx.get(server.url + "/weights_checksum", timeout=120).json()["checksums"]) == 30 * 9 + 2  # all
    bad_name = httpx.get(server.url + "/weights_checksum", params={"names": "bogus"})
    assert bad_name.status_code == 400 and "bogus" in bad_name.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "invalid_weights": 0}
    version = server.post("/get_weight_version").status_code  # GET only
    assert version == 405
    assert httpx.get(server.url + "/get_weight_version").json()["weight_version"] == 1
    after = server.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert after["meta_info"]["weight_version"] == 1 and after["output_ids"] != before["output_ids"]
    assert server.post("/update_weights_from_disk", {"model_path": smollm2_dir}).json()["weight_version"] == 2
    again = server.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert again["output_ids"] == before["output_ids"]
    bad = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"]

    released = server.post("/release_memory_occupation", {})
    assert released.status_code == 409 and "enable_memory_saver" in released.json()["error"]["message"]
    assert server.post("/pause_generation", {"mode": "keep"}).json()["success"]
    paused = server.post("/generate", {"text": "x", "sampling_params": GREEDY})
    assert paused.status_code == 409 and "paused" in paused.json()["error"]["message"]
    assert server.post("/continue_generation").json()["success"]
    answers = []
    long = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    runner = threading.Thread(target=lambda: answers.append(server.post("/generate", long)))
    runner.start()
    time.sleep(1.0)
    assert server.post("/pause_generation", {"mode": "abort"}).json()["success"]
    runner.join(30)
    assert answers[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.post("/continue_generation").json()["success"]
    assert server.post("/pause_generation", {"mode": "sideways"}).status_code == 400
    assert server.post("/flush_cache").json()["success"]
    assert server.post("/abort_request", {"abort_all": True}).json()["success"]
    # a JSON body sent as a form (curl -d's default type) is read as JSON on the control routes too
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert httpx.post(server.url + "/abort_request", content=b'{"abort_all": true}', headers=form).json()["success"]
    assert httpx.post(server.url + "/pause_generation", content=b'{"mode": "sideways"}',
                      headers=form).status_code == 400
    metrics = httpx.get(server.url + "/metrics").text
    assert "rollout_engine_weight_version 2.0" in metrics and "rollout_engine_kv_usage_ratio" in metrics
    for family in ("rollout_engine_time_to_first_token_seconds", "rollout_engine_step_duration_seconds"):
        count = next(line for line in metrics.splitlines() if line.startswith(family + "_count"))
        inf = next(line for line in metrics.splitlines() if line.startswith(family + '_bucket{le="+Inf"}'))
        assert float(count.split()[-1]) > 0 and count.split()[-1] == inf.split()[-1], family


ABUSE = [
    ("/generate", b"{bad json"),
    ("/generate", b"[]"),
    ("/generate", b"null"),
    ("/generate", b'"text"'),
    ("/generate", b"{}"),
    ("/generate", json.dumps({"text": "a", "input_ids": [1]}).encode()),
    ("/generate", json.dumps({"text": 5}).encode()),
    ("/generate", json.dumps({"text": []}).encode()),
    ("/generate", json.dumps({"text": ""}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": ""}).encode()),
    ("/generate", json.dumps({"input_ids": []}).encode()),
    ("/generate", json.dumps({"input_ids": [[]]}).encode()),
    ("/generate", json.dumps({"input_ids": ["a"]}).encode()),
    ("/generate", json.dumps({"input_ids": [10 ** 12]}).encode()),
    ("/generate", json.dumps({"input_ids": [-1]}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"n": 10 ** 9}}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 10 ** 12}}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"temperature": -1}}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"top_p": "x"}}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": {"bogus": 1}}).encode()),
    ("/generate", json.dumps({"text": "a", "sampling_params": 3}).encode()),
    ("/generate", json.dumps({"text": "a", "bogus_field": 1}).encode()),
    ("/generate", json.dumps({"text": "a", "stream": "yes"}).encode()),
    ("/generate", json.dumps({"text": "a", "top_logprobs_num": 10 ** 6, "return_logprob": True}).encode()),
    ("/generate", json.dumps({"text": "a", "rid": 5}).encode()),
    ("/generate", b"[" * 100_000 + b"]" * 100_000),
    ("/generate", ('{"text": ' + "[" * 5000 + '"a"' + "]" * 5000 + "}").encode()),
    ("/v1/completions", b"{}"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "a", "max_tokens": -5}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "a", "n": "two"}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": []}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": "hello"}).encode()),
    ("/update_weights_from_disk", json.dumps({"model_path": 5}).encode()),
    ("/pause_generation", json.dumps({"mode": 1}).encode()),
    ("/abort_request", b"{oops"),
    ("/no/such/route", b"{}"),
]


@pytest.mark.slow  # many requests; run by .ci/run after the fast tests
def test_abuse_gets_4xx_never_500_and_the_server_stays_up(server):
    good = {"text": PROMPTS[0], "sampling_params": GREEDY}
    for path, raw in ABUSE:
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert 400 <= r.status_code < 500, (path, raw[:80], r.status_code, r.text[:300])
        assert "error" in r.json(), (path, raw[:80])
        assert server.post("/generate", good).status_code == 200, (path, raw[:80])
    huge = httpx.post(server.url + "/generate", content=b"x" * (40 << 20), timeout=60)
    assert huge.status_code == 413
    assert server.post("/generate", good).status_code == 200


def test_an_idle_keep_alive_connection_stays_usable(server):
    """A pooled client connection idle past uvicorn's default keep-alive (5 s)
    is still open: the next request on it gets its answer, not a read error."""
    from urllib.parse import urlparse

    url = urlparse(server.url)
    request = (f"GET /health HTTP/1.1\r\nHost: {url.hostname}\r\nConnection: keep-alive\r\n\r\n").encode()

    def response(sock) -> bytes:  # one whole response: headers, then Content-Length bytes of body
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data  # the server closed the connection
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += sock.recv(65536)
        return head

    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        for attempt in range(2):
            sock.sendall(request)
            head = response(sock)
            assert head.startswith(b"HTTP/1.1 200"), (attempt, head[:100])
            if attempt == 0:
                time.sleep(7)


def test_a_disconnected_stream_frees_its_kv(server):
    long = {"text": PROMPTS, "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=long, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = httpx.get(server.url + "/get_server_info").json()
        metrics = httpx.get(server.url + "/metrics").text
        if info["admitted_samples"] == 0 and "rollout_engine_running_requests 0.0" in metrics:
            break
        time.sleep(0.2)
    assert info["admitted_samples"] == 0
    assert "rollout_engine_running_requests 0.0" in metrics
    assert 'rollout_engine_finished_requests_total{reason="abort"}' in metrics


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


def _readme_block(marker: str) -> str:
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    after = text[text.index(f"<!-- {marker} -->"):]
    start = after.index("```")
    body = after[after.index("\n", start) + 1:]
    return body[:body.index("```")]


def test_the_readme_examples_run(server):
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    curl = _readme_block("server-curl").strip().replace("http://127.0.0.1:30000", server.url)
    out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Paris" in json.loads(out.stdout)["text"], out.stdout + out.stderr
    script = _readme_block("server-openai").replace("http://127.0.0.1:30000", server.url)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stdout + out.stderr


@pytest.mark.slow  # a server subprocess of its own; run by .ci/run after the fast tests
def test_serve_refuses_a_busy_port_and_bad_flags_before_loading(smollm2_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, message in ((["--port", str(port)], "cannot listen on"),
                               (["--port", "70000"], "--port: must be in"),
                               (["--host", ""], "--host"), (["--host", "999.1.1.1"], "--host"),
                               (["--api-key", ""], "--api-key"),
                               (["--max-queued-requests", "0"], "--max-queued-requests")):
            out = subprocess.run([sys.executable, "-m", "rollout_engine.cli", "serve", "--model", smollm2_dir, *flags],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 2 and message in out.stderr, (flags, out.stderr[-500:])
            assert "serving" not in out.stdout


@pytest.mark.slow  # a server process of its own; run by .ci/run after the fast tests
def test_the_banner_comes_once_the_port_accepts_connections(tmp_path):
    """`serving ... on http://...` is the signal scripts wait for: a request
    sent the moment it appears is answered (no connection refused)."""
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=0), tmp_path)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rollout_engine.cli", "serve", "--model", folder, "--device", "cpu",
                             "--port", str(port), "--max-total-tokens", "2048"],
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
        assert f"on http://127.0.0.1:{port}" in next(line for line in lines if "serving" in line)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


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
        rss_first = _rss(srv.proc.pid)
        second, _ = asyncio.run(_load(srv.url, "second"))
        rss_second = _rss(srv.proc.pid)
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
                            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
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


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


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
        workers = _children(srv.proc.pid)
        assert workers, "the TP=2 server has no worker process"
    finally:
        code, took = srv.stop(timeout=30)
    assert code == 0, (code, "".join(srv.output)[-2000:])
    time.sleep(1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and
                open(f"/proc/{w}/stat").read().split()[2] != "Z"], "a TP worker outlived the server"


def test_weights_from_a_trainer_over_the_sync_group_routes(server, smollm2_dir):
    """The RL path of server-mode frameworks: the trainer joins the weight-sync
    group and broadcasts; the server receives through its routes (gloo here)."""
    from safetensors.torch import load_file

    from rollout_engine.integrations.weight_sender import WeightSender

    before = server.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    start_version = before["meta_info"]["weight_version"]
    tensors = [(n, t * 0.5 if n.endswith("mlp.down_proj.weight") else t)
               for n, t in load_file(os.path.join(smollm2_dir, "model.safetensors")).items()]
    port, replies = _free_port(), []
    join = threading.Thread(target=lambda: replies.append(server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})))
    join.start()
    sender = WeightSender("127.0.0.1", port, world_size=2, backend="gloo", bucket_bytes=64 << 20)
    join.join(60)
    assert replies[0].json()["success"]
    names, dtypes, shapes = WeightSender.metadata(tensors)
    body = {"names": names, "dtypes": [str(d) for d in dtypes], "shapes": [list(s) for s in shapes],
            "bucket_bytes": 64 << 20, "weight_version": str(start_version + 10)}
    update = threading.Thread(target=lambda: replies.append(server.post("/update_weights_from_distributed", body)))
    update.start()
    sender.send(tensors)
    update.join(120)
    assert replies[1].json() == {"success": True, "message": "weights updated", "weight_version": start_version + 10}
    after = server.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == start_version + 10
    assert server.post("/destroy_weights_update_group", {}).json()["success"]
    sender.close()
    assert server.post("/update_weights_from_disk", {"model_path": smollm2_dir}).json()["success"]
    restored = server.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    assert restored["output_ids"] == before["output_ids"]


def test_serve_from_python_with_engine_kwargs(tmp_path):
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("llama", seed=4), tmp_path / "tiny")
    port = _free_port()
    code = (f"from rollout_engine.server import serve\n"
            f"serve({{'model': {folder!r}, 'device': 'cpu', 'max_total_tokens': 1024}}, port={port}, "
            f"max_queued_requests=8)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        assert httpx.get(url + "/get_server_info").json()["server"]["max_queued_requests"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


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
