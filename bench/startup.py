"""Where `hetero chat`'s start-up goes: imports, metadata, tokenizer, weights, KV cache, first token.

    python3 bench/startup.py                       # the demo model, as `hetero chat` loads it
    python3 bench/startup.py model.gguf --device cuda
    python3 bench/startup.py --write-8b /tmp/l3.gguf   # first write a Llama-3-8B-shaped Q4_K_M GGUF

Each phase is timed by wrapping the loader's own steps (no change to the library); "to the
prompt" is what a user waits for before `>>> `. Run it twice: the first run fills the caches
(converted tokenizer, NF4 weights, compiled kernels), the second is the warm start.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="HF folder or .gguf (default: the demo model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--write-8b", metavar="PATH", help="write a Llama-3-8B-shaped Q4_K_M GGUF there and time it")
    a = ap.parse_args()
    if a.write_8b:
        from gguf_util import write_llama3_8b_q4km

        t = time.perf_counter()
        write_llama3_8b_q4km(Path(a.write_8b))
        print(f"wrote {a.write_8b} in {time.perf_counter() - t:.1f} s")
        a.model = a.model or a.write_8b

    phases: dict[str, float] = {}
    t = time.perf_counter()
    import torch  # noqa: F401

    phases["import torch"] = time.perf_counter() - t
    t = time.perf_counter()
    import cli  # noqa: F401  (what `hetero` imports before it parses the command line)
    import hetero
    from hetero.app import build as loading

    phases["import hetero, cli"] = time.perf_counter() - t
    for name in ("open_checkpoint", "Tokenizer", "load_model", "TieredKVCache", "Runner"):
        _wrap(loading, name, phases)
    try:
        from offload import build

        for name in ("load_from_plan", "runtime_from_plan"):
            _wrap(build, name, phases)
        _wrap(loading, "_plan", phases)
    except ImportError:
        pass
    t = time.perf_counter()
    engine = hetero.load(a.model, device=a.device, weights=a.weights, parallel=1)  # as `hetero chat`
    total = time.perf_counter() - t
    phases["load: other"] = total - sum(v for k, v in phases.items() if not k.startswith("import"))
    prompt = time.perf_counter() - T0
    t = time.perf_counter()
    next(iter(engine.chat([{"role": "user", "content": "Hi"}], max_new_tokens=1, temperature=0)))
    first = time.perf_counter() - t
    for k, v in phases.items():
        print(f"{k:24} {v:7.2f} s")
    print(f"{'to the prompt':24} {prompt:7.2f} s   (process start to a loaded engine)")
    print(f"{'first token of Hi':24} {first:7.2f} s")


def _wrap(module, name: str, phases: dict[str, float]) -> None:
    fn = getattr(module, name, None)
    if fn is None:
        return

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t

    setattr(module, name, timed)


if __name__ == "__main__":
    main()
