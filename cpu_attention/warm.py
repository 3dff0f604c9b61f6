"""Compile the decode kernels ahead of their first use, side by side in background processes.

On a machine whose Numba cache is empty, a KV dtype's first `decode_attention` call compiles
its kernel: 10–25 s (bf16 fastest, int4 slowest; most of it Numba's own passes and LLVM over
one large parallel function). The dtypes' kernels are independent, and Numba's compiler lock
serializes compiles within one process, so `start` compiles each in its own process
(`cache=True` writes the result to Numba's cache) while the caller does other work, e.g.
`hetero profile` measuring the GPU; the caller's own first call then loads from the cache in
well under a second. `python -m cpu_attention.warm bf16 int8` does the same in the foreground.

`submit_load` is the engine's warm-up in this process (`Engine.load_kernels`): Numba and the
kernels' modules imported, and Numba's one-time set-up done, in a background thread while the
chat waits at its prompt (the engine's first prefill waits for it).

This module imports nothing heavy at the top (torch and the kernels load in `compile_decode`),
so the CLI can start the compiles (`start_early`) before it imports torch itself.
"""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

HOST_DTYPES = ("bf16", "int8", "int4")  # the host tier's KV dtypes (`layout.KVDtype` values)


def compile_decode(dtype: str) -> None:
    """One small `decode_attention` call over a `dtype` pool (head dim 128, 4 q heads a kv head):
    compiles, or loads from Numba's cache, the kernel the engine's calls use for every head dim
    that is a multiple of the vector width and head group of 4, 8, ... (kernels are compiled per
    argument type, G % 4 included, not per shape). Before it, the appends a step makes: one
    token, a batch's 17 × 2 rows (int8 spreads those over its threads: another kernel, 3–4 s
    to compile on 2 cores), and a call that completes a block it did not start (int4 quantizes
    it over its threads: another kernel too)."""
    import torch

    from cpu_attention import _numba
    from cpu_attention.decode import decode_attention
    from cpu_attention.pool import HostKVPool
    from cpu_attention.layout import KVDtype

    _numba.configure()  # the engine's settings: the cached kernel is the one it loads
    BS, D = 16, 128
    pool = HostKVPool(1, 2, 2, BS, D, dtype=KVDtype(dtype))
    for a, b in ((0, 1), (0, BS + 1), (BS + 1, 2 * BS)):  # the last completes block 1
        pool.write(0, torch.arange(a, b), torch.zeros(b - a, 2, D), torch.zeros(b - a, 2, D))
    tables = torch.arange(2, dtype=torch.int32).reshape(1, 2)
    decode_attention(pool, 0, torch.zeros(1, 8, D), tables, torch.tensor([2 * BS - 1]), D**-0.5, threads=1)


def load() -> None:
    """What an engine's first prefill would otherwise pay before its first kernel runs (2-core
    machine): importing Numba and the kernels' modules (~0.3 s), Numba's settings (`configure`),
    and Numba's one-time set-up at its first compile or cache load (its typing and lowering
    registries, scipy's BLAS bindings among them, and the threading layer: ~0.6 s), here through
    a one-row int8 GEMV, the kernel every prefill's logits go through."""
    import torch

    from cpu_attention import _numba, append, decode, linear  # noqa: F401  (append, decode: imported)

    _numba.configure()
    linear.Int8Linear.from_quantized(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1))(torch.zeros(1, 1))


def submit_load() -> Future:
    """`load` running in a background thread from now on; `.result()` waits for it and raises what
    failed."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-kernels")
    try:
        return pool.submit(load)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the job


class Compiles:
    """Background compiles, one process per KV dtype; `wait` joins them."""

    def __init__(self, dtypes: tuple[str, ...]):
        self.dtypes = tuple(dtypes)
        self.t0 = time.perf_counter()
        code = "import sys; from cpu_attention.warm import main; main(sys.argv[1:])"
        self.procs = {dt: subprocess.Popen([sys.executable, "-c", code, dt], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True) for dt in self.dtypes}
        self.seconds: dict[str, float] = {}  # per dtype, the process's own figure (compile or cache load)

    def wait(self, timeout_s: float = 600.0) -> list[str]:
        """Wait for every process; → a line for each that failed (its kernel then compiles on
        first use in the caller, as without this)."""
        failed = []
        for dt, p in self.procs.items():
            try:
                out, err = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - self.t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            if p.returncode:
                tail = (err or "").strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
                failed.append(f"compiling the {dt} kernels in the background failed ({tail[0]:.120})")
            for line in (out or "").splitlines():  # main's "<dtype>: <s> s"
                name, _, rest = line.partition(": ")
                if rest.endswith(" s"):
                    self.seconds[name] = float(rest[:-2])
        return failed


_started: dict[tuple[str, ...], Compiles] = {}


def start(dtypes: tuple[str, ...] = HOST_DTYPES) -> Compiles:
    """Each dtype's decode kernel compiling in its own process from now on; `.wait()` for them. A
    second call for the same dtypes takes over the first call's processes (the CLI starts them
    before it imports torch; the profile's measurement then waits for them)."""
    dtypes = tuple(dtypes)
    return _started.pop(dtypes, None) or Compiles(dtypes)


def start_early(dtypes: tuple[str, ...] = HOST_DTYPES) -> None:
    """`start` now, for a later `start` of the same dtypes to take over."""
    _started[tuple(dtypes)] = Compiles(tuple(dtypes))


def main(args: list[str]) -> None:
    for name in args or HOST_DTYPES:
        t = time.perf_counter()
        compile_decode(name)
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
