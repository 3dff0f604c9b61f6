"""`hetero bench`: llama-bench-shaped rows through the engine; random-weight models of named shapes."""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hetero
from cli import app
from hetero.app.bench import BenchRow, render
from hetero.config import Arch, ModelConfig
from hetero.random_weights import SHAPES, RandomCheckpoint
from planner.tensors import total_params


def run(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.output


def test_bench_json_rows_on_the_demo_model():
    code, out, log = run("bench", "-p", "32", "-n", "16", "-r", "2", "-o", "json", "--device", "cpu")
    assert code == 0, log
    rows = json.loads(out)
    assert [r["test"] for r in rows] == ["pp32", "tg16"]
    for r in rows:
        assert set(r) == {f.name for f in dataclasses.fields(BenchRow)}
        assert r["model"].startswith("SmolLM2") and r["params"] > 100e6 and r["n_batch"] == 1 and r["n_depth"] == 0
        assert len(r["samples_ts"]) == 2 and all(x > 0 for x in r["samples_ts"])
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2) and r["stddev_ts"] >= 0
        assert r["plan"] and r["kv_dtype"] == "bf16"
    assert (rows[0]["n_prompt"], rows[0]["n_gen"], rows[1]["n_prompt"], rows[1]["n_gen"]) == (32, 0, 0, 16)


@pytest.mark.parametrize("args,words", [
    (["-o", "xml"], "md, json, csv"),
    (["-d", "0,lots"], "-d"),
    (["-r", "0"], "-r"),
    (["--random", "llama9-1t"], "llama3-8b"),
])
def test_bad_bench_options_say_what_to_change(args, words):
    code, _, log = run("bench", "-p", "4", "-n", "2", *args)
    assert code == 2 and words in log and "Traceback" not in log


def _row(**kw) -> BenchRow:
    base = dict(model="m", params=1000, device="cpu", weights="int8", kv_dtype="bf16", n_batch=1, n_depth=0,
                n_prompt=0, n_gen=8, test="tg8", avg_ts=10.0, stddev_ts=0.5, samples_ts=[9.5, 10.5], plan="p, q")
    return BenchRow(**{**base, **kw})


def test_md_and_csv_outputs():
    rows = [_row(), _row(test="tg8 @ d64", n_depth=64)]
    md = render(rows, "md").splitlines()
    assert len(md) == 4 and "10.00 ± 0.50" in md[2] and "tg8 @ d64" in md[3]
    parsed = list(csv.DictReader(io.StringIO(render(rows, "csv"))))
    assert [r["test"] for r in parsed] == ["tg8", "tg8 @ d64"] and parsed[0]["plan"] == "p, q"
    assert parsed[1]["samples_ts"] == "9.500;10.500"


def test_random_shapes_have_the_real_parameter_counts():
    ck = RandomCheckpoint(SHAPES["llama3-8b"])
    assert sum(t.nbytes for t in ck.tensors.values()) // 2 == total_params(SHAPES["llama3-8b"]) == 8_030_261_248
    assert total_params(SHAPES["qwen3-30b-a3b"]) == pytest.approx(30.5e9, rel=0.01)


@pytest.mark.parametrize("arch", [Arch.LLAMA, Arch.QWEN3_MOE])
def test_a_random_model_loads_through_hetero_load_and_generates(arch):
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, qk_norm=True) if arch is Arch.QWEN3_MOE else {}
    cfg = ModelConfig(arch=arch, vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256, name="tiny", **moe)
    ck = RandomCheckpoint(cfg)
    assert ck.get("model.layers.0.self_attn.q_proj.weight").equal(ck.get("model.layers.0.self_attn.q_proj.weight"))
    e = hetero.load(ck, device="cpu", ctx_size=64)
    assert e.tok is None and e.info["model"] == "random:tiny"
    out = list(e.generate([1, 2, 3], max_new_tokens=4, temperature=0.0))
    assert len(out) == 4 and all(0 <= c.token < 160 for c in out)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_run_names_each_benchmark_script_and_device_run_calls_only_those():
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    run_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_mod)  # the table alone: no benchmark is imported
    listing = run_mod.listing()
    assert {f.stem for f in BENCH.glob("*.py")} - {"run", "kv_pools", "step_calls"} == set(run_mod.BENCHMARKS)  # helpers aside
    for name in run_mod.BENCHMARKS:
        src = (BENCH / f"{name}.py").read_text()
        assert "\ndef main(" in src and 'if __name__ == "__main__":' in src and name in listing
        assert "sys.path" not in src
    script = [ln for ln in (BENCH / "device_run.sh").read_text().splitlines() if not ln.lstrip().startswith("#")]
    stages = set(re.findall(r"python3 -m bench\.(\w+)", "\n".join(script)))
    assert stages and stages <= set(run_mod.BENCHMARKS)


def test_step_calls_times_the_engines_calls_and_puts_them_back(tiny):
    """`bench.budget --calls`: a split step's calls counted and timed within, the methods as they
    were after."""
    from bench.step_calls import per_step, timed_calls
    from offload.runner import Runner

    before = Runner.__dict__["_part"]
    e = hetero.load(tiny("llama")[0], device="cpu", weights="f32", tokenizer=False, block_size=4, gpu_kv_tokens=4,
                    kv_dtype="f32")
    with timed_calls() as found:
        out = [c.token for c in e.generate([3, 17, 42, 99, 5, 150, 7, 8], max_new_tokens=4, temperature=0.0)]
    rows = per_step(found, 3)
    assert len(out) == 4 and Runner.__dict__["_part"] is before
    assert rows["Runner.decode"]["calls_a_step"] == 1.0 and rows["Runner._part"]["calls_a_step"] >= 1
    assert all(r["ms_a_step"] >= 0 and r["us_a_call"] >= 0 for r in rows.values())
