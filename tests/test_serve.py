"""`hetero serve` through the official `openai` client and plain HTTP: one server for the module,
started on a free local port with the embedded demo model on the CPU."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARALLEL, QUEUE, CTX = 8, 2, 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, the /health statuses seen while it started); the server stops after the module."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")  # a file: a full pipe would block the server
    # one CPU-attention thread: steady on a busy 2-core CI machine
    proc = subprocess.Popen([sys.executable, "cli.py", "serve", "--port", str(port), "--device", "cpu",
                             "--parallel", str(PARALLEL), "--queue", str(QUEUE), "-c", str(CTX), "-t", "1"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    url, seen = f"http://127.0.0.1:{port}", []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()
            try:
                seen.append(httpx.get(url + "/health", timeout=5).status_code)
                if seen[-1] == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert seen and seen[-1] == 200, "the server did not become healthy"
        yield url, seen
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(open(log.name).read()[-5000:])  # shown by pytest when a test of the module failed
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics, parsed by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_idle(url: str) -> dict:
    """/metrics once no request runs or waits (the engine frees a cancelled sequence at its next step)."""
    deadline = time.monotonic() + 120
    while True:
        m = metrics(url)
        if m[("hetero:num_requests_running", ())] == 0 and m[("hetero:num_requests_waiting", ())] == 0:
            return m
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.2)


def prompt_len(messages) -> int:
    from hetero.checkpoint import open_checkpoint
    from hetero.demo import demo_model_path
    from hetero.tokenizer import Tokenizer

    path = demo_model_path()
    return len(Tokenizer(path, True, open_checkpoint(path).config.eos_token_ids).apply_chat_template(messages))


def test_health_is_503_while_loading_then_200(server):
    _, seen = server
    assert 503 in seen and seen[-1] == 200


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2")


def test_chat_completion_answers_paris_with_right_usage(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=40)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == prompt_len(QUESTION)
    assert 1 <= r.usage.completion_tokens <= 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = client.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # the same greedy answer, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_max_tokens_ends_with_length_and_counts(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    ids = client.completions.create(model=model_id, prompt=[1, 2, 3, 4, 5], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens <= 2


def test_stop_strings_cut_the_text(client, model_id):
    full = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert "Paris" in text
    cut = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stop=["aris"])
    assert cut.choices[0].text == text[:text.index("aris")] and cut.choices[0].finish_reason == "stop"


def test_concurrent_streams_give_the_text_of_a_lone_request(client, model_id):
    def ask(i: int, out: dict) -> None:
        stream = client.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=24,
                                                stream=True)
        out[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    lone: dict[int, str] = {}
    ask(0, lone)
    many: dict[int, str] = {}
    threads = [threading.Thread(target=ask, args=(i, many)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "Paris" in lone[0]
    assert [many[i] for i in range(8)] == [lone[0]] * 8


def _stream_lines(client: httpx.Client, url: str, body: dict):
    return client.stream("POST", url + "/v1/completions", json={**body, "stream": True})


def test_disconnect_mid_stream_frees_the_sequence_kv(server):
    url, _ = server
    before = wait_idle(url)
    with httpx.Client(timeout=60) as c:
        with _stream_lines(c, url, {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got == 3:
                    break  # leave mid-stream: the connection closes
    after = wait_idle(url)
    assert after[("hetero:kv_cache_tokens", (("tier", "cpu"),))] == 0
    assert after[("hetero:kv_cache_tokens", (("tier", "gpu"),))] == 0
    aborted = ("hetero:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    gen = ("hetero:generation_tokens_total", ())
    assert 3 <= after[gen] - before[gen] < 900


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server):
    url, _ = server
    before = wait_idle(url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes the connection
        httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True},
                   timeout=httpx.Timeout(60, read=3))
    after = wait_idle(url)
    aborted = ("hetero:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after[("hetero:kv_cache_tokens", (("tier", "cpu"),))] == 0
    gen = ("hetero:generation_tokens_total", ())
    assert after[gen] - before[gen] < 900


BAD = [  # (body or raw text, status, words the message must contain)
    ('{"messages": [', 400, "not valid JSON"),
    ({"messages": QUESTION, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "gpt-4"),
    ({"messages": QUESTION, "temperature": 5}, 400, "temperature"),
    ({"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ({"messages": QUESTION, "min_p": 1.5}, 400, "min_p"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hello " * 2000}]}, 400, f"maximum context length is {CTX} tokens"),
    ({"prompt": "x"}, 400, "messages"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, words):
    url, _ = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    if "context" in words:
        assert "tokens" in err["message"] and err["code"] == "context_length_exceeded"
    ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=client.models.list().data[0].id, prompt="hi " * 3000, max_tokens=2)


def test_a_full_queue_answers_503_with_retry_after(server):
    url, _ = server
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        held = []
        try:
            for _ in range(PARALLEL + QUEUE):
                r = c.send(c.build_request("POST", url + "/v1/completions", json=body), stream=True)
                held.append(r)
                assert r.status_code == 200
            over = c.post(url + "/v1/completions", json={**body, "stream": False})
            assert over.status_code == 503 and "busy" in over.json()["error"]["message"]
            assert f"--parallel {PARALLEL}, --queue {QUEUE}" in over.json()["error"]["message"]
            assert int(over.headers["retry-after"]) >= 1
        finally:
            for r in held:
                r.close()
    m = wait_idle(url)
    assert m[("hetero:kv_cache_tokens", (("tier", "cpu"),))] == 0


def test_metrics_parse_and_carry_the_names(server):
    url, _ = server
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=120).status_code == 200
    m = metrics(url)
    names = {name for name, _ in m}
    for n in ["hetero:num_requests_running", "hetero:num_requests_waiting", "hetero:prompt_tokens_total",
              "hetero:generation_tokens_total", "hetero:time_to_first_token_seconds_bucket",
              "hetero:inter_token_latency_seconds_bucket", "hetero:kv_cache_tokens", "hetero:kv_cache_usage_perc",
              "hetero:transfer_bytes_total", "hetero:cpu_attention_busy_ratio", "hetero:cpu_experts_busy_ratio",
              "hetero:gpu_busy_ratio",
              "hetero:plan_kv_tokens_per_seq", "hetero:plan_info"]:
        assert n in names, n
    assert m[("hetero:generation_tokens_total", ())] >= 3 and m[("hetero:prompt_tokens_total", ())] >= 1
    assert m[("hetero:time_to_first_token_seconds_count", ())] >= 1
    assert {t for n, labels in m for k, t in labels if n == "hetero:kv_cache_tokens"} == {"gpu", "cpu"}
    assert m[("hetero:plan_kv_tokens_per_seq", (("tier", "cpu"),))] == CTX
    stats = httpx.get(url + "/stats", timeout=10).json()
    assert stats["totals"]["generation_tokens"] == m[("hetero:generation_tokens_total", ())]


def _monitor(*args):
    from typer.testing import CliRunner

    from cli import app

    r = CliRunner().invoke(app, ["monitor", *args])
    return r.exit_code, r.output


def test_monitor_once_prints_the_panels_with_the_generation_rate(server, client, model_id):
    import re

    url, _ = server
    client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    code, out = _monitor(url, "--once")
    assert code == 0, out
    for title in ("throughput", "latency", "requests", "KV cache", "memory", "devices", "plan", "TTFT", "ITL",
                  "CPU attention", "GPU", "PCIe", "CPU tier"):
        assert title in out, title
    busy = re.search(r"generation\s+[\d.]+ t/s now\s+([\d.]+) t/s while busy", out)
    assert busy and float(busy.group(1)) > 0, out
    assert re.search(r"TTFT\s+p50 \d", out) and "KV per sequence: 0 GPU / 1.0k CPU" in out


def test_monitor_once_against_a_dead_url_says_so_and_exits_2():
    url = f"http://127.0.0.1:{free_port()}"
    code, out = _monitor(url, "--once")
    assert code == 2 and "cannot reach" in out and url in out and "Traceback" not in out
