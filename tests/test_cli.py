"""Bad input through the CLI: a clear message naming the file or the limit, exit code 2, no traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from conftest import make_tiny
from gguf_util import write_gguf

ROOT = Path(__file__).resolve().parents[1]


def run(*args, input=None):
    r = CliRunner().invoke(app, list(args), input=input)
    return r.exit_code, r.output  # click ≥ 8.2 mixes stderr into output


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, "llama")
    return d


def _no_traceback(out):
    assert "Traceback" not in out


def test_missing_path(tmp_path):
    code, out = run("chat", "-m", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in out and "nope" in out
    _no_traceback(out)


def test_folder_without_config(tmp_path):
    code, out = run("chat", str(tmp_path))
    assert code == 2 and "config.json" in out


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    code, out = run("chat", str(tmp_path))
    assert code == 2 and "BertForMaskedLM" in out and "LlamaForCausalLM" in out


def test_truncated_safetensors(folder, tmp_path):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, out = run("chat", str(bad))
    assert code == 2 and "truncated" in out and "model.safetensors" in out


def test_corrupt_safetensors_header(folder, tmp_path):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"{not json" + b"x" * 100)
    code, out = run("chat", str(bad))
    assert code == 2 and "corrupt" in out


def test_truncated_and_corrupt_gguf(folder, tmp_path):
    good = tmp_path / "m.gguf"
    write_gguf(good, folder, "llama")
    data = good.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) - 1000])
    code, out = run("chat", str(tmp_path / "short.gguf"))
    assert code == 2 and "short.gguf" in out and ("truncated" in out or "corrupt" in out)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(300))
    code, out = run("chat", str(tmp_path / "junk.gguf"))
    assert code == 2 and "junk.gguf" in out
    _no_traceback(out)
    (tmp_path / "notgguf.bin").write_bytes(b"hello world")
    code, out = run("chat", str(tmp_path / "notgguf.bin"))
    assert code == 2 and "GGUF" in out


def test_bad_option_values(tmp_path):
    code, out = run("chat", "--kv-dtype", "int3")
    assert code == 2 and "int3" in out


def test_prompt_longer_than_context():
    code, out = run("chat", "-c", "16", input="Tell me everything about the history of France.\n")
    assert code == 2 and "context" in out and "16" in out and "--ctx-size" in out


def test_piped_chat_answers_only(tmp_path):
    """The installed `hetero` command, stdin not a terminal: one answer line per input line."""
    env = {**os.environ, "HETERO_TEMPERATURE": "0"}  # every flag also reads HETERO_<LONG NAME>
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "chat", "-n", "32"],
                       input="What is the capital of France?\n", capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and ">>>" not in r.stdout


def test_profile_experts_says_what_is_wrong(folder, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    code, out = run("profile-experts", str(folder), "--prompts", str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read the prompts" in out
    _no_traceback(out)
    code, out = run("profile-experts", "--prompts", str(prompts), "--device", "cpu")  # the demo model
    assert code == 2 and "not a mixture-of-experts model" in out
    _no_traceback(out)
