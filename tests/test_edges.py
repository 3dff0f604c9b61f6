"""Bad input at the edge: every option, config field and checkpoint header is checked before any
math runs; one message naming the value and the fix, exit code 2, no traceback."""
import dataclasses
import json
import struct

import pytest
from typer.testing import CliRunner

from cli import app
from conftest import make_tiny
from planner import HardwareProfile
from planner import profile as profile_mod
from planner.profile import AttnRate


def run(*args, input=None, env=None):
    r = CliRunner().invoke(app, list(args), input=input, env=env)
    flat = " ".join(r.output.replace("│", " ").split())  # typer's error box wraps lines
    assert "Traceback" not in r.output
    return r.exit_code, flat


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, "llama")
    return d


@pytest.fixture
def profile_json(tmp_path):
    p = tmp_path / "hw.json"
    p.write_text(HardwareProfile.synthetic(8).to_json())
    return str(p)


@pytest.mark.parametrize("args, words", [
    (["-t", "0"], ["--threads", "0"]),
    (["--gpu-mem", "banana"], ["--gpu-mem", "banana", "8GiB"]),
    (["--cpu-mem", "banana"], ["--cpu-mem", "banana"]),
    (["--gpu-mem", "0GiB"], ["--gpu-mem", "more than 0"]),
    (["--top-k", "-3"], ["--top-k", "-3"]),
    (["-n", "0"], ["--max-new-tokens", "0"]),
    (["-n", "-1"], ["--max-new-tokens", "-1"]),
    (["-c", "-5"], ["--ctx-size", "-5"]),
    (["--temp", "-1"], ["--temp", "-1"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--min-p", "1.5"], ["--min-p", "1.5"]),
    (["--kv-dtype", "int3"], ["--kv-dtype", "int3", "int8"]),
    (["--weights", "3bit"], ["--weights", "3bit"]),
    (["--context-overflow", "wrap"], ["--context-overflow", "drop-turns"]),
])
def test_bad_options_stop_before_loading(args, words):
    code, out = run("chat", *args)
    assert code == 2
    for w in words:
        assert w in out
    if args[0] == "--temp":  # only the bad option is named
        assert "top_p" not in out and "--top-p" not in out


@pytest.mark.parametrize("args", [["-t", "0"], ["--gpu-mem", "banana"], ["-n", "0"], ["--kv-dtype", "int3"]])
def test_plan_shares_the_options(args, profile_json):
    code, out = run("plan", "--profile", profile_json, *args)
    assert code == 2 and args[0] in out


def test_bad_option_from_the_environment():
    code, out = run("chat", env={"HETERO_THREADS": "0"})
    assert code == 2 and "HETERO_THREADS" in out


def test_version():
    code, out = run("--version")
    assert code == 0 and out.startswith("hetero ")


def _with_config(folder, tmp_path, **changes):
    bad = tmp_path / "m"
    bad.mkdir(exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None: the field is missing
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    return bad


@pytest.mark.parametrize("changes, words", [
    ({"hidden_size": -64}, ["hidden_size", "-64"]),
    ({"hidden_size": 0}, ["hidden_size", "0"]),
    ({"hidden_size": 1e12}, ["hidden_size", "1000000000000"]),
    ({"hidden_size": 96}, ["shape", "hidden_size"]),  # plausible, but the weights disagree
    ({"num_key_value_heads": 3}, ["num_key_value_heads", "3"]),
    ({"head_dim": 32}, ["q_proj", "head_dim"]),  # heads × head_dim no longer matches the weights
    ({"vocab_size": 0}, ["vocab_size"]),
    ({"intermediate_size": None}, ["lacks", "intermediate_size"]),
])
@pytest.mark.parametrize("command", ["chat", "plan"])
def test_config_fields_checked(folder, tmp_path, changes, words, command, profile_json):
    bad = _with_config(folder, tmp_path, **changes)
    extra = ["--profile", profile_json] if command == "plan" else []
    code, out = run(command, str(bad), *extra)
    assert code == 2, out
    for w in words:
        assert w in out


def _rewrite_header(src, dst, edit):
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def _chat_with_header(folder, tmp_path, name: str, **change) -> tuple[int, str]:
    """`hetero chat` over a copy of the tiny model whose safetensors header entry `name` is changed."""
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    _rewrite_header(folder / "model.safetensors", bad / "model.safetensors", lambda h: h[name].update(**change))
    return run("chat", str(bad))


def test_header_shape_disagrees_with_byte_count(folder, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    code, out = _chat_with_header(folder, tmp_path, name, shape=[64, 65])
    assert code == 2 and "corrupt" in out and name in out


def test_shape_wrong_but_bytes_match(folder, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"  # [64, 96] stored as [96, 64]: same bytes, wrong math
    code, out = _chat_with_header(folder, tmp_path, name, shape=[96, 64])
    assert code == 2 and name in out and "[96, 64]" in out and "[64, 96]" in out


def test_integer_weights_rejected(folder, tmp_path):
    name = "model.norm.weight"
    code, out = _chat_with_header(folder, tmp_path, name, dtype="I32")
    assert code == 2 and name in out and "I32" in out


def test_folder_without_tokenizer_files(folder):
    code, out = run("chat", str(folder))
    assert code == 2 and "tokenizer" in out and "sentencepiece" not in out and "tokenizer.json" in out


def test_unwritable_cache_falls_back_with_a_note(folder, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(profile_mod, "measure", lambda quick=False: HardwareProfile.synthetic(8))
    code, out = run("plan", str(folder), env={"XDG_CACHE_HOME": str(blocker / "cache")})
    assert code == 0 and "offloaded" in out
    assert "cannot cache" in caplog.text and "XDG_CACHE_HOME" in caplog.text


def test_profile_of_other_kernels_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    old = HardwareProfile.synthetic(8)
    path.write_text(old.to_json().replace(profile_mod.kernels_version(), "0123456789abcdef"))
    calls = []
    monkeypatch.setattr(profile_mod, "measure", lambda quick=False: calls.append(1) or old)
    profile_mod.load_or_measure(path=path)
    assert calls == [1]
    profile_mod.load_or_measure(path=path)  # now current: read from the cache
    assert calls == [1]


def test_implausible_profile_is_flagged(folder, tmp_path):
    hw = HardwareProfile.synthetic(8)
    rates = tuple(AttnRate(r.dtype, r.threads, 0.96 if (r.dtype, r.threads) == ("int8", 8) else r.gbps)
                  for r in hw.cpu_attention)
    busy, fine = tmp_path / "busy.json", tmp_path / "fine.json"
    busy.write_text(dataclasses.replace(hw, cpu_attention=rates).to_json())
    fine.write_text(hw.to_json())
    code, out = run("plan", str(folder), "--profile", str(busy))
    assert code == 0 and "implausible" in out and "int8" in out and "--refresh" in out
    code, out = run("plan", str(folder), "--profile", str(fine))
    assert code == 0 and "implausible" not in out


def test_weights_alone_too_big_do_not_suggest_a_smaller_context(folder, profile_json):
    code, out = run("plan", str(folder), "--profile", profile_json, "--device", "cpu", "--cpu-mem", "4KiB")
    assert code == 2 and "weights alone" in out and "--ctx-size" not in out


@pytest.mark.parametrize("args, words", [
    (("serve", "--port", "0"), ["--port", "≥ 1"]),
    (("serve", "--kv-dtype", "int3"), ["--kv-dtype", "int3", "bf16, int8, int4"]),
    (("serve", "--gpu-mem", "banana"), ["--gpu-mem", "banana"]),
    (("serve", "--top-p", "2"), ["--top-p", "(0, 1]"]),
    (("serve", "-np", "0"), ["--parallel", "≥ 1"]),
    (("bench", "-o", "xml"), ["--output", "md, json, csv"]),
    (("bench", "-r", "0"), ["--repetitions", "≥ 1"]),
    (("bench", "--kv-dtype", "bf16,int3"), ["--kv-dtype", "int3"]),
    (("bench", "--weights", "2bit"), ["--weights", "2bit"]),
])
def test_serve_and_bench_take_the_shared_options(args, words):
    """serve and bench read the options chat and plan read: the same checks, before any work."""
    code, out = run(*args)
    assert code == 2, out
    for w in words:
        assert w in out, (w, out)


def test_load_reports_progress_layer_by_layer(folder):
    """`hetero.load(progress=)` hears of every layer's weights and then the head (the chat's bar)."""
    import hetero

    seen = []
    hetero.load(folder, device="cpu", tokenizer=False, progress=lambda done, total: seen.append((done, total)))
    L = 2  # conftest's tiny models
    assert seen == [(i, L + 1) for i in range(1, L + 2)]


def test_a_cuda_load_runs_on_a_thread_that_ends_with_it(monkeypatch):
    """Where CUDA runs the engine, `hetero.load` loads on a thread of its own (OpenMP pools its CPU
    work makes end with it), with the caller's CUDA device, and returns or raises as if inline; a
    CPU load stays on the caller's thread."""
    import threading

    import torch

    from hetero.app import build as build_mod
    from hetero.errors import UserError

    seen = {}

    def fake_load(model=None, **kw):
        seen["thread"] = threading.current_thread()
        if model == "bad":
            raise UserError("refused")
        return f"engine of {model}"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("device", d))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.setdefault("synced", True))
    load = build_mod._on_own_thread_with_cuda(fake_load)
    assert load("m", device="cuda") == "engine of m"
    assert seen["thread"] is not threading.current_thread() and seen["device"] == 3 and seen["synced"]
    assert not seen["thread"].is_alive()
    with pytest.raises(UserError, match="refused"):
        load("bad")
    assert load("m", device="cpu") == "engine of m" and seen["thread"] is threading.current_thread()
