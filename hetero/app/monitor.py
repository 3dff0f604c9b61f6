"""`hetero monitor`: a live full-screen view of a running `hetero serve`, from its `/stats` JSON.

Twice a second: generation and prompt tokens/s with sparklines of the last minute, TTFT and
inter-token latency (p50 / p95), requests running and waiting, KV tokens per tier against each
tier's capacity, memory against the plan's budgets, CPU-attention and GPU busy, PCIe bytes/s
each way, and the plan's split. `q` quits, `p` pauses. A server that goes away is shown as
disconnected and polled again; `render_once` gives one frame as plain text (`--once`).
"""
from __future__ import annotations

import io
import json
import sys
import time
import urllib.error
import urllib.request

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from hetero.errors import UserError

DEFAULT_URL = "http://127.0.0.1:8080"
REFRESH_S = 0.5
_BLOCKS = "▁▂▃▄▅▆▇█"


class Unreachable(Exception):
    """The server did not answer /stats."""


def fetch(url: str, timeout: float = 2.0) -> dict:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/stats", timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise Unreachable(str(getattr(e, "reason", e))) from e


def render_once(url: str = DEFAULT_URL, width: int = 100) -> str:
    """One frame as plain text; a UserError when nothing answers at `url`."""
    try:
        snap = fetch(url)
    except Unreachable as e:
        raise UserError(f"cannot reach a hetero server at {url} ({e}): start one with `hetero serve`, "
                        f"or pass its URL") from None
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(frame(snap, url))
    return buf.getvalue()


def run_monitor(url: str = DEFAULT_URL) -> None:
    """The live view until `q` (or Ctrl+C)."""
    keys = _Keys()
    snap, state, paused = None, "connecting…", False
    with keys, Live(Text(f"connecting to {url}…"), screen=True, auto_refresh=False) as live:
        while True:
            if not paused:
                try:
                    snap, state = fetch(url), "connected"
                except Unreachable as e:
                    state = f"disconnected ({e}); retrying"
            status = "paused (p resumes)" if paused else state
            live.update(frame(snap, url, status) if snap else Text(f"{url}: {status}"), refresh=True)
            key = keys.read(REFRESH_S)
            if key == "q":
                return
            if key == "p":
                paused = not paused


# ---------------------------------------------------------------------- one frame
def frame(s: dict, url: str, status: str = "connected") -> RenderableType:
    info, r, tot = s["info"], s["rates"], s["totals"]
    head = Text.assemble(("hetero monitor", "bold"), f"  {url}  ·  {str(info.get('model', '?')).rsplit('/', 1)[-1]}"
                         f"  ·  {info.get('device', '?')}  ·  up {_dur(s['uptime_s'])}  ·  {status}"
                         f"{'' if s.get('loaded', True) else '  ·  loading'}  ·  q quits, p pauses")
    per = s["per_second"]
    tput = Table.grid(padding=(0, 2))
    tput.add_row("generation", f"{r['generation_tok_s']:7.1f} t/s now", f"{r['generation_tok_s_busy']:7.1f} t/s while busy",
                 _spark(per["generation_tokens"]))
    tput.add_row("prompt", f"{r['prompt_tok_s']:7.1f} t/s now", f"{tot['prompt_tokens']:7d} tok total",
                 _spark(per["prompt_tokens"]))
    if tot.get("draft_tokens"):
        tput.add_row("drafts", f"{r['draft_acceptance']:7.0%} kept", f"{tot['accepted_tokens']:7d} of {tot['draft_tokens']}", "")
    lat, ttft, itl = Table.grid(padding=(0, 2)), s["latency"]["ttft"], s["latency"]["itl"]
    lat.add_row("TTFT", f"p50 {_ms(ttft['p50'])}", f"p95 {_ms(ttft['p95'])}", f"({ttft['count']} in 1 min)")
    lat.add_row("ITL", f"p50 {_ms(itl['p50'])}", f"p95 {_ms(itl['p95'])}", f"({itl['count']} in 1 min)")
    req = Table.grid(padding=(0, 2))
    done = ", ".join(f"{k} {v}" for k, v in sorted(tot["requests"].items())) or "none yet"
    req.add_row("running", str(s["running"]), "waiting", str(s["waiting"]), "finished", done)
    kv = Table.grid(padding=(0, 2))
    for tier in ("gpu", "cpu"):
        k = s["kv"][tier]
        kv.add_row(f"{tier.upper()} tier", _bar(k["usage"]) if k["capacity"] else "(none)",
                   f"{_num(k['tokens'])} / {_num(k['capacity'])} tok")
    mem = Table.grid(padding=(0, 2))
    for dev, m in sorted(s["memory"].items()):
        used, budget = m.get("used"), m.get("budget")
        mem.add_row(dev, _bar(used / budget) if used is not None and budget else "", f"{_size(used)} / "
                    f"{_size(budget) if budget else 'no budget'}")
    dev = Table.grid(padding=(0, 2))
    dev.add_row("CPU attention", _bar(r["cpu_attention_busy"], 10), "GPU", _bar(r["gpu_busy"], 10),
                "engine", _bar(r["engine_busy"], 10))
    if r.get("cpu_experts_busy"):  # a MoE model with experts on the CPU
        dev.add_row("CPU experts", _bar(r["cpu_experts_busy"], 10), "", "", "", "")
    dev.add_row("PCIe", f"↑ {_size(r['h2d_bytes_s'])}/s host→device", "", f"↓ {_size(r['d2h_bytes_s'])}/s device→host")
    split = info.get("split", {})
    plan = Text(f"{info.get('plan') or info.get('kv_tiers', '')}\nKV per sequence: {_num(split.get('gpu', 0))} GPU / "
                f"{_num(split.get('cpu', 0))} CPU  ·  parallel {info.get('parallel', '?')}")
    return Group(head, Panel(tput, title="throughput (last minute)", title_align="left"),
                 Panel(lat, title="latency", title_align="left"), Panel(req, title="requests", title_align="left"),
                 Panel(kv, title="KV cache", title_align="left"), Panel(mem, title="memory", title_align="left"),
                 Panel(dev, title="devices (last 10 s)", title_align="left"),
                 Panel(plan, title="plan", title_align="left"))


def _spark(values: list[float], width: int = 30) -> str:
    """One character per len(values)/width seconds (their sum), scaled to the largest."""
    step = max(1, -(-len(values) // width))
    values = [sum(values[i:i + step]) for i in range(0, len(values), step)]
    top = max(values, default=0) or 1
    return "".join(" " if v == 0 else _BLOCKS[min(7, int(v / top * 7.999))] for v in values)


def _bar(frac: float, width: int = 20) -> str:
    frac = max(0.0, min(1.0, frac))
    n = round(frac * width)
    return "█" * n + "░" * (width - n) + f" {frac * 100:5.1f}%"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


def _num(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _size(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _dur(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Keys:
    """Single keys from a terminal without Enter (cbreak mode); only waits when stdin is not one."""

    def __enter__(self):
        self.fd, self.old = None, None
        if sys.stdin.isatty():
            import termios
            import tty

            self.fd = sys.stdin.fileno()
            self.old = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc) -> bool:
        if self.old is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.old)
        return False

    def read(self, timeout: float) -> str | None:
        if self.fd is None:
            time.sleep(timeout)
            return None
        import select

        ready, _, _ = select.select([self.fd], [], [], timeout)
        return sys.stdin.read(1).lower() if ready else None
