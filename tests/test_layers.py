"""The packages import downward only, without cycles: the import-linter contracts in pyproject.toml."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_no_source_file_outside_tests_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.glob("[!.]*/**/*.py") if "tests" not in p.parts
            and (n := len(p.read_text().splitlines())) > 400}
    long.update({p.name: n for p in ROOT.glob("*.py") if (n := len(p.read_text().splitlines())) > 400})
    assert not long, long


def test_the_kernel_packages_know_nothing_of_cuda_memory_or_options():
    """cpu_attention: no torch.cuda; the kernel packages read none of our environment variables
    (options are the CLI's and `hetero.load`'s)."""
    for p in (ROOT / "cpu_attention").glob("*.py"):
        assert "torch.cuda" not in p.read_text(), p.name
    for p in [*(ROOT / "cpu_attention").glob("*.py"), *(ROOT / "gpu_ops").glob("*.py")]:
        assert "HETERO_" not in p.read_text(), p.name


def test_the_chat_reaches_its_prompt_without_importing_numba():
    """Numba's import (~0.2 s of `hetero chat`'s start-up on 2 cores) is left to the engine's
    background load (`cpu_attention.warm.submit_load`): the CLI, the engine's modules and the
    int8 weights' classes import without it."""
    code = ("import sys, cli, hetero.app.build, hetero.app.repl, offload.int8_cache, cpu_attention.linear\n"
            "assert 'numba' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_importing_changes_no_settings_until_configure_is_called():
    """Importing the packages leaves Numba's settings alone; `cpu_attention.configure()` (engine
    start) makes them."""
    code = (
        "import os, numba\n"
        "os.environ.pop('NUMBA_THREADING_LAYER', None)\n"
        "before = (list(numba.config.THREADING_LAYER_PRIORITY), numba.config.CPU_FEATURES)\n"
        "import cpu_attention.decode, cpu_attention.linear, cpu_attention.append, planner.search, offload.runner\n"
        "import hetero.app.build, cli\n"
        "assert (list(numba.config.THREADING_LAYER_PRIORITY), numba.config.CPU_FEATURES) == before\n"
        "import cpu_attention\n"
        "cpu_attention.configure()\n"
        "assert numba.config.THREADING_LAYER_PRIORITY[0] == 'omp'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
