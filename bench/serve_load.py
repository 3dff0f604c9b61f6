"""A bounded load run against `hetero serve` on this machine (127.0.0.1 only).

    python3 -m bench.serve_load [--clients 32] [--seconds 60] [--parallel 16] [--url URL]

Starts a CPU server with the demo model on a free local port (or uses --url), then runs
`--clients` threads for `--seconds`, each sending requests back to back: chat and plain
completions, streamed and not, 4–48 new tokens, and every eighth one a stream the client drops
after a few tokens. Reports requests done, errors (any status but 200, a stream without
`data: [DONE]`, a transport error), tokens generated, and the server's resident memory (from
its /stats) when ready, after the run, and once idle again.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten.",
           "Explain what a KV cache is in one sentence.", "Name three colors."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(parallel: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "cli.py", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", "--parallel", str(parallel), "--queue", "256", "-c", "1024"],
                            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit("the server did not become healthy in 600 s")


def one_request(c: httpx.Client, url: str, rng: random.Random) -> tuple[bool, int, str]:
    """(ok, tokens, what went wrong)."""
    chat, stream, drop = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.125
    body = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7]), "seed": rng.randint(0, 99)}
    text = rng.choice(PROMPTS)
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not (stream or drop):
        r = c.post(url + path, json=body)
        if r.status_code != 200:
            return False, 0, f"{r.status_code} {r.text[:200]}"
        return True, r.json()["usage"]["completion_tokens"], ""
    with c.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return False, 0, f"{r.status_code} {r.read()[:200]!r}"
        n, done = 0, False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                d = json.loads(line[6:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                elif drop and d.get("choices"):
                    return True, 0, ""  # leave mid-stream on purpose: the server cancels it
        return (True, n, "") if done else (False, n, "stream ended without [DONE]")


def rss(url: str) -> int | None:
    return httpx.get(url + "/stats", timeout=10).json()["memory"].get("host", {}).get("used")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--url", help="an already running server (default: start one)")
    a = ap.parse_args()
    proc = None
    if a.url is None:
        log = Path(tempfile.mkdtemp()) / "server.log"
        proc, url = start_server(a.parallel, log)
        print(f"server on {url} (log: {log})")
    else:
        url = a.url
    try:
        before = rss(url)
        done, errors, tokens, problems = [0], [0], [0], []
        lock = threading.Lock()
        deadline = time.monotonic() + a.seconds

        def client(i: int) -> None:
            rng = random.Random(i)
            with httpx.Client(timeout=600) as c:
                while time.monotonic() < deadline:
                    try:
                        ok, n, why = one_request(c, url, rng)
                    except httpx.HTTPError as e:
                        ok, n, why = False, 0, f"{type(e).__name__}: {e}"
                    with lock:
                        done[0] += 1
                        tokens[0] += n
                        if not ok:
                            errors[0] += 1
                            problems.append(why)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        after = rss(url)
        time.sleep(5)
        idle = rss(url)
        stats = httpx.get(url + "/stats", timeout=10).json()
        mib = lambda b: f"{b / 2**20:.0f} MiB" if b else "?"  # noqa: E731
        print(f"{a.clients} clients, {a.seconds:.0f} s (last requests ended at {wall:.0f} s): {done[0]} requests, "
              f"{errors[0]} errors, {tokens[0]} tokens counted by clients, "
              f"{stats['totals']['generation_tokens']} generated by the server; finished {stats['totals']['requests']}")
        print(f"server RSS: {mib(before)} before the run, {mib(after)} after the run, {mib(idle)} idle 5 s later; "
              f"KV now {stats['kv']['cpu']['tokens']} tokens, running {stats['running']}, waiting {stats['waiting']}")
        for p in problems[:10]:
            print("error:", p)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
