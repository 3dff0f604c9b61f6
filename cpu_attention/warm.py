"""Compile the decode kernels ahead of their first use, side by side in background processes.

On a machine whose Numba cache is empty, a KV dtype's first `decode_attention` call compiles
its kernel: 15–40 s on one core (bf16 fastest, int4 slowest; most of it Numba's own passes and
LLVM over one large parallel function, which no setting we tried shortened much). The dtypes'
kernels are independent, and Numba's compiler lock serializes compiles within one process, so
`start` compiles each in its own process (`cache=True` writes the result to Numba's cache) while
the caller does other work, e.g. `hetero profile` measuring the GPU; the caller's own first
call then loads from the cache in well under a second. `python -m cpu_attention.warm bf16 int8`
does the same in the foreground.
"""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from cpu_attention.decode import decode_attention
from cpu_attention.layout import HostKVPool, KVDtype


def compile_decode(dtype: KVDtype) -> None:
    """One small `decode_attention` call over a `dtype` pool (head dim 128, 4 q heads a kv head):
    compiles, or loads from Numba's cache, the kernel every head dim that is a multiple of the
    vector width uses (kernels are compiled per argument type, not per shape)."""
    BS, D = 16, 128
    pool = HostKVPool(1, 2, 2, BS, D, dtype=dtype)
    tables = torch.arange(2, dtype=torch.int32).reshape(1, 2)
    decode_attention(pool, 0, torch.zeros(1, 8, D), tables, torch.tensor([2 * BS - 1]), D**-0.5, threads=1)


class Compiles:
    """Background compiles, one process per KV dtype (`start`); `wait` joins them."""

    def __init__(self, dtypes: list[KVDtype]):
        self.t0 = time.perf_counter()
        code = "import sys; from cpu_attention.warm import main; main(sys.argv[1:])"
        self.procs = {dt: subprocess.Popen([sys.executable, "-c", code, dt.value], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True) for dt in dtypes}

    def wait(self, timeout_s: float = 600.0) -> list[str]:
        """Wait for every process; → a line for each that failed (its kernel then compiles on
        first use in the caller, as without this)."""
        failed = []
        for dt, p in self.procs.items():
            try:
                _, err = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - self.t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                tail = (err or "").strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
                failed.append(f"compiling the {dt.value} kernels in the background failed ({tail[0]:.120})")
        return failed


def start(dtypes: list[KVDtype]) -> Compiles:
    """Compile each dtype's decode kernel in its own process, now; `.wait()` for them."""
    return Compiles(dtypes)


def main(args: list[str]) -> None:
    for name in args or [dt.value for dt in (KVDtype.BF16, KVDtype.INT8, KVDtype.INT4)]:
        t = time.perf_counter()
        compile_decode(KVDtype(name))
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
