"""The packages import downward only, without cycles: the import-linter contracts in pyproject.toml."""
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
