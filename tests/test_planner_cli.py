"""`hetero plan` on a header-only checkpoint, the proof that no tensor data is read, and
`hetero profile`'s cache."""
from __future__ import annotations

import builtins
import json
import mmap
import struct
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hetero.checkpoint import iter_layer_names
from hetero.config import config_from_hf
from planner import HardwareProfile, Plan
from planner import profile as profile_mod
from planner.commands import plan_cmd, profile_cmd
from planner.tensors import total_params

LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("plan")(plan_cmd)
    app.command("profile")(profile_cmd)
    return app


def _shape(name: str, hf: dict) -> tuple[int, ...]:
    h, v, i = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * h // hf["num_attention_heads"]
    for key, shape in (("q_proj", (h, h)), ("o_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)),
                       ("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)), ("layernorm", (h,)),
                       ("embed_tokens", (v, h)), ("lm_head", (v, h)), ("model.norm", (h,))):
        if key in name:
            return shape
    raise AssertionError(name)


def write_sparse_checkpoint(folder: Path, hf: dict) -> int:
    """A real-sized safetensors file with only its header written: the data region is a hole."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    cfg = config_from_hf(hf)
    names = ["model.embed_tokens.weight"]
    for layer in range(cfg.num_layers):
        names += list(iter_layer_names(cfg, layer))
    names += ["model.norm.weight", "lm_head.weight"]
    header, off = {}, 0
    for n in names:
        shape = _shape(n, hf)
        size = 2
        for d in shape:
            size *= d
        header[n] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    blob = json.dumps(header).encode()
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)
    return off


@pytest.fixture
def synthetic_profile(tmp_path: Path) -> Path:
    p = tmp_path / "hw.json"
    p.write_text(HardwareProfile.synthetic(8).to_json())
    return p


def test_plan_on_header_only_checkpoint(tmp_path, synthetic_profile):
    nbytes = write_sparse_checkpoint(tmp_path / "llama", LLAMA3_8B_HF)
    assert nbytes == pytest.approx(2 * total_params(config_from_hf(LLAMA3_8B_HF)), rel=1e-3)
    r = CliRunner().invoke(_app(), ["plan", str(tmp_path / "llama"), "--profile", str(synthetic_profile), "-c", "32768"])
    assert r.exit_code == 0, r.output
    assert "14.96 GiB" in r.output or "15.0 GiB" in r.output  # the checkpoint's size, from headers
    assert "offloaded 32/32 layers' weights to GPU" in r.output
    assert "bottleneck:" in r.output and "decode" in r.output and "automatic choices" in r.output
    r = CliRunner().invoke(_app(), ["plan", str(tmp_path / "llama"), "--profile", str(synthetic_profile),
                                    "-c", "32768", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["checkpoint"]["nbytes"] == nbytes and doc["checkpoint"]["tensors"] == 291
    plan = Plan.from_dict(doc)  # the JSON document is the Plan itself
    assert plan.workload.ctx_size == 32768 and plan.prediction.decode_tok_s > 0


def test_plan_reads_no_tensor_data(tmp_path, synthetic_profile, monkeypatch):
    write_sparse_checkpoint(tmp_path / "llama", LLAMA3_8B_HF)
    st = tmp_path / "llama" / "model.safetensors"
    with open(st, "rb") as f:
        header_end = 8 + struct.unpack("<Q", f.read(8))[0]
    read = {"bytes": 0, "max_pos": 0}
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            read["bytes"] += len(data)
            read["max_pos"] = max(read["max_pos"], self._f.tell())
            return data

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self._f.close()

    def counting_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return Counting(f) if str(path).endswith(".safetensors") else f

    def forbidden(*a, **kw):
        raise AssertionError("tensor data must not be mapped or loaded")

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(mmap, "mmap", forbidden)
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", forbidden)
    r = CliRunner().invoke(_app(), ["plan", str(tmp_path / "llama"), "--profile", str(synthetic_profile), "--json"])
    assert r.exit_code == 0, r.output
    assert 0 < read["bytes"] <= header_end and read["max_pos"] <= header_end


def test_plan_no_fit_exits_2_with_the_fix(tmp_path, synthetic_profile):
    write_sparse_checkpoint(tmp_path / "llama", LLAMA3_8B_HF)
    r = CliRunner().invoke(_app(), ["plan", str(tmp_path / "llama"), "--profile", str(synthetic_profile),
                                    "--gpu-mem", "100MiB"])
    assert r.exit_code == 2
    assert "short by" in r.output and "cuda:0" in r.output and "--gpu-mem" in r.output
    r = CliRunner().invoke(_app(), ["plan", "--profile", str(synthetic_profile), "--gpu-mem", "lots"])
    assert r.exit_code == 2 and "8GiB" in r.output


def test_plan_flags_reach_the_plan(synthetic_profile):
    r = CliRunner().invoke(_app(), ["plan", "--profile", str(synthetic_profile), "-c", "8192", "-np", "4", "-t", "3",
                                    "--kv-dtype", "int8", "--sub-batches", "2", "--cpu-mem", "20GiB", "--json"])
    assert r.exit_code == 0, r.output
    p = Plan.from_json(r.stdout)
    assert (p.workload.ctx_size, p.workload.batch, p.threads, p.sub_batches) == (8192, 4, 3, 2)
    assert p.kv.host_dtype.value == "int8" and p.budget.host_bytes == 20 * 2**30


def test_profile_cache_honours_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_measure(quick=False):
        calls.append(1)
        return HardwareProfile.synthetic(12)

    monkeypatch.setattr(profile_mod, "measure", fake_measure)
    r = CliRunner().invoke(_app(), ["profile", "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hetero" / "profile.json").is_file()
    assert json.loads(r.stdout)["gpu_name"] == "synthetic 12 GiB GPU"
    r = CliRunner().invoke(_app(), ["profile"])
    assert r.exit_code == 0 and "PCIe" in r.output and len(calls) == 1  # cached
    r = CliRunner().invoke(_app(), ["profile", "--refresh", "--json"])
    assert r.exit_code == 0 and len(calls) == 2


def test_measure_runs_without_gpu():
    hw = profile_mod.measure(quick=True)
    assert hw.dram_read_gbps > 0 and hw.cpu_gemv_gbps > 0 and hw.physical_cores >= 1
    assert {r.dtype for r in hw.cpu_attention} == {"bf16", "int8", "int4"}
    assert all(r.run_cost > 0.5 and r.item_s >= 0 for r in hw.cpu_attention)  # a run of 8 rows, 32 sequences
    assert HardwareProfile.from_json(hw.to_json()) == hw
    assert hw.versions["torch"] and hw.created


def test_plan_predicts_speculative_decoding_from_an_acceptance_rate(synthetic_profile):
    """--draft-accept: the predicted speed-up grows with the share of drafts kept, and none is
    predicted where nothing is kept; a rate outside [0, 1) is refused."""
    gains = []
    for rate in (0.0, 0.5, 0.9):
        r = CliRunner().invoke(_app(), ["plan", "--profile", str(synthetic_profile), "-c", "8192", "--json",
                                        "--draft-accept", str(rate)])
        assert r.exit_code == 0, r.output
        spec = json.loads(r.stdout)["speculative"]
        gains.append((spec["draft_tokens"], spec["speed_up"]))
    assert gains[0] == (0, 1.0)
    assert 1.0 <= gains[1][1] < gains[2][1] and gains[2][0] >= gains[1][0] >= 1
    r = CliRunner().invoke(_app(), ["plan", "--profile", str(synthetic_profile), "--draft-accept", "1"])
    assert r.exit_code == 2 and "outside [0, 1)" in r.output


def test_plan_by_default_plans_what_a_run_with_the_same_options_runs(tmp_path):
    """Without -p or -n, `hetero plan` plans the workload `hetero chat`, `serve` and `hetero.load`
    plan for (a conversation that may fill the context): the same placement, KV split and
    sub-batches; with -p it plans for that prompt instead."""
    import torch

    from hetero.app.build import _plan

    write_sparse_checkpoint(tmp_path / "llama", LLAMA3_8B_HF)
    h200 = Path(__file__).parent / "data" / "h200_profile.json"
    args = ["plan", str(tmp_path / "llama"), "--profile", str(h200), "-c", "8192", "-np", "16", "--gpu-mem", "8GiB",
            "--json"]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 0, r.output
    shown = Plan.from_dict(json.loads(r.stdout))
    run = _plan(config_from_hf(LLAMA3_8B_HF), None, torch.device("cuda"), 8192, 16, "8GiB", None, None,
                hw=HardwareProfile.from_json(h200.read_text()))
    assert (shown.kv, shown.sub_batches, shown.placements) == (run.kv, run.sub_batches, run.placements)
    assert shown.workload == run.workload
    r = CliRunner().invoke(_app(), args + ["-p", "7936"])
    assert r.exit_code == 0, r.output
    assert Plan.from_dict(json.loads(r.stdout)).workload.prompt_tokens == 7936 != run.workload.prompt_tokens
