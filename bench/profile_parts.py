"""Where `hetero profile`'s time goes: the CLI's imports (`-X importtime`'s largest), then
`planner.profile.measure()` under cProfile, as the CLI calls it (top functions by cumulative time).

`python3 bench/profile_parts.py` (device tool; after a profile, so Numba's and Triton's caches are warm)."""
import cProfile
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import cli"], capture_output=True, text=True, cwd=ROOT)
rows = []
for line in r.stderr.splitlines():  # "import time: self [us] | cumulative | imported package"
    parts = line.split("|")
    if len(parts) == 3 and parts[1].strip().isdigit():
        rows.append((int(parts[1]), parts[2].rstrip()))
print("largest imports under `import cli` (cumulative s):")
for us, name in sorted(rows, reverse=True)[:25]:
    print(f"  {us / 1e6:6.2f}  {name}")
t = time.perf_counter()
import cli  # noqa: E402,F401

print(f"import cli: {time.perf_counter() - t:.2f} s")
from planner import profile  # noqa: E402

pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
hw = profile.measure()
pr.disable()
print(f"measure: {time.perf_counter() - t:.2f} s; {hw.notes}")
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
