"""`rollout-engine serve` as a subprocess on a free localhost port, talked to
only through real clients (httpx, the openai package), on SmolLM2."""
from __future__ import annotations

import json
import os
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

from server_procs import PROMPTS, Server, free_port  # noqa: E402


httpx = pytest.importorskip("httpx")


openai = pytest.importorskip("openai")


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
    scored = server.post("/generate", {"input_ids": ref[0].prompt_token_ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 1}).json()  # SGLang's scoring
    want = local.generate(input_ids=[ref[0].prompt_token_ids],
                          sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=True))[0]
    assert scored["output_ids"] == [] and scored["text"] == "" and scored["meta_info"]["completion_tokens"] == 0
    triples = scored["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in triples] == want.prompt_token_ids[1:]
    assert max(abs(t[0] - w) for t, w in zip(triples, want.prompt_logprobs[1:])) < 1e-5
    default = server.post("/generate", {"input_ids": ref[0].prompt_token_ids, "return_logprob": True,
                                        "logprob_start_len": None, "sampling_params": {"max_new_tokens": 0}})
    assert default.status_code == 200 and "input_token_logprobs" not in default.json()["meta_info"]


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
    # a message without content: only an assistant's may leave it out (as OpenAI)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user"}], max_tokens=2)
    assert err.value.body["param"] == "messages.content" and "messages[0]" in err.value.body["message"]
    answered = client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}])
    assert answered.choices[0].finish_reason in ("length", "stop")
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
    assert bad.json()["error"]["param"] == "model_path"
    for version in (-1, "\u00b2", 1.5, True, 2**70):  # a superscript digit, a float, a bool, past 64 bits
        refused = server.post("/update_weights_from_disk", {"model_path": smollm2_dir, "weight_version": version})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight_version", refused.json()
    (tmp_path / "empty").mkdir()
    empty = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "empty")})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "model_path", empty.json()
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"not safetensors")
    damaged = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "empty")})
    assert damaged.status_code == 400 and "not a readable safetensors file" in damaged.json()["error"]["message"]

    released = server.post("/release_memory_occupation", {})
    assert released.status_code == 409 and "enable_memory_saver" in released.json()["error"]["message"]
    bogus = server.post("/release_memory_occupation", {"tags": ["bogus"]})  # the input first, then the state
    assert bogus.status_code == 400 and "tags: unknown ['bogus']" in bogus.json()["error"]["message"], bogus.json()
    assert bogus.json()["error"]["param"] == "tags"
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
    ("/generate", json.dumps({"text": "a", "logprob_start_len": "0", "return_logprob": True}).encode()),
    ("/generate", json.dumps({"text": "a", "logprob_start_len": -2}).encode()),
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


def test_an_unknown_sampling_field_names_the_closest_one():
    from rollout_engine.server.errors import ApiError
    from rollout_engine.server.params import sglang_params

    with pytest.raises(ApiError) as exc:
        sglang_params({"max_new_token": 8}, False, 0)
    assert exc.value.status == 400 and exc.value.param == "sampling_params.max_new_token"
    assert exc.value.message.endswith("is not a known sampling parameter; did you mean 'max_new_tokens'?")
    with pytest.raises(ApiError, match=r"sampling_params.bogus is not a known sampling parameter$"):
        sglang_params({"bogus": 1}, False, 0)


@pytest.mark.slow  # many requests; run by .ci/run after the fast tests
def test_abuse_gets_4xx_never_500_and_the_server_stays_up(server):
    good = {"text": PROMPTS[0], "sampling_params": GREEDY}
    for path, raw in ABUSE:
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert 400 <= r.status_code < 500, (path, raw[:80], r.status_code, r.text[:300])
        assert "error" in r.json(), (path, raw[:80])
        assert server.post("/generate", good).status_code == 200, (path, raw[:80])
    # the engine's own refusals name their field as the schema's do
    for body, field in (({"input_ids": [10 ** 12]}, "input_ids"),
                        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature")):
        r = server.post("/generate", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    model = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    for body, field in (({"prompt": "a", "top_p": 2}, "top_p"), ({"prompt": [10 ** 9]}, "prompt")):  # OpenAI's names
        r = server.post("/v1/completions", {"model": model, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
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


def test_weights_from_a_trainer_over_the_sync_group_routes(server, smollm2_dir):
    """The RL path of server-mode frameworks: the trainer joins the weight-sync
    group and broadcasts; the server receives through its routes (gloo here)."""
    from safetensors.torch import load_file

    from rollout_engine.integrations.weight_sender import WeightSender

    before = server.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    start_version = before["meta_info"]["weight_version"]
    tensors = [(n, t * 0.5 if n.endswith("mlp.down_proj.weight") else t)
               for n, t in load_file(os.path.join(smollm2_dir, "model.safetensors")).items()]
    port, replies = free_port(), []
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


@pytest.mark.parametrize("field,value", [("host", " "), ("port", 70000), ("api_key", ""), ("max_body_bytes", 10),
                                         ("max_queued_requests", 0), ("served_model_name", " ")])
def test_server_config_refuses_a_bad_field_by_name(field, value):
    from rollout_engine.server.config import ServerConfig

    with pytest.raises(ValueError, match=f"^{field} must"):
        ServerConfig(**{field: value})
