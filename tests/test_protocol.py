"""The server's stop strings and live numbers, without a server."""
import pytest

from hetero.app.live import LiveStats
from hetero.app.protocol import StopFilter


def test_stop_string_split_across_tokens_is_cut_and_never_sent():
    f = StopFilter(["\nUser:"])
    sent = [f.push(t) for t in ["Paris", " is", "\nUs", "er", ": more"]]
    assert "".join(sent) == "Paris is" and f.hit


def test_text_that_only_looks_like_a_stop_string_is_sent_in_full():
    f = StopFilter(["STOP"])
    sent = "".join(f.push(t) for t in ["a ST", "OR", "Y"]) + f.flush()
    assert sent == "a STORY" and not f.hit


def test_without_stop_strings_text_passes_at_once():
    f = StopFilter([])
    assert f.push("abc") == "abc" and f.flush() == ""


def test_snapshot_rates_percentiles_and_kv_usage():
    live = LiveStats({"device": "cpu"})
    live.step(prompt_tokens=10, generation_tokens=1, wall=0.1, decode=False, cpu_attention=0.0, gpu=0.0, h2d=0, d2h=0)
    for _ in range(4):
        live.step(prompt_tokens=0, generation_tokens=2, wall=0.05, decode=True, cpu_attention=0.02, gpu=0.0,
                  h2d=100, d2h=50)
    for x in (0.1, 0.2, 0.3, 0.4, 1.0):
        live.latency("itl", x)
    live.state(running=2, kv={"gpu": 0, "cpu": 48}, kv_capacity={"gpu": 0, "cpu": 96}, memory=None)
    s = live.snapshot()
    assert s["totals"]["generation_tokens"] == 9 and s["totals"]["h2d_bytes"] == 400
    assert s["rates"]["generation_tok_s_busy"] == pytest.approx(9 / 0.2)  # over the seconds spent decoding
    assert s["latency"]["itl"] == {"p50": 0.3, "p95": 1.0, "count": 5}
    assert s["latency"]["ttft"]["count"] == 0
    assert s["kv"]["cpu"]["usage"] == 0.5 and s["kv"]["gpu"]["usage"] == 0.0 and s["running"] == 2
    assert sum(s["per_second"]["generation_tokens"]) == 9 and len(s["per_second"]["generation_tokens"]) == 60
