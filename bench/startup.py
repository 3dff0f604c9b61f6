"""Where `hetero chat`'s start-up goes: imports, metadata, tokenizer, weights, KV cache, first token.

    python3 -m bench.startup                       # the demo model, as `hetero chat` loads it
    python3 -m bench.startup model.gguf --device cuda
    python3 -m bench.startup --write-8b /tmp/l3.gguf   # first write a Llama-3-8B-shaped Q4_K_M GGUF
    python3 -m bench.startup --tokenizer-only tok.gguf  # the demo tokenizer alone (~2 MB), for a host
                                                         # without the demo model: --write-8b ... --tokenizer-from tok.gguf

Each phase is timed by wrapping the steps `hetero.app.build` calls (open the checkpoint, the
tokenizer, read or measure the hardware profile, plan, load the weights, build the runtime and
KV cache; no change to the library); "to the prompt" is what a user waits for before `>>> `. Run it twice: the first run fills the caches
(converted tokenizer, NF4 weights, compiled kernels), the second is the warm start.
"""
from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="HF folder or .gguf (default: the demo model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--write-8b", metavar="PATH", help="write a Llama-3-8B-shaped Q4_K_M GGUF there and time it")
    ap.add_argument("--tokenizer-from", metavar="GGUF", help="--write-8b: copy this GGUF's tokenizer (default: the demo model's)")
    ap.add_argument("--tokenizer-only", metavar="PATH", help="write a GGUF holding only the demo model's tokenizer there, and exit")
    a = ap.parse_args()
    if a.tokenizer_only:
        from tests.gguf_util import write_tokenizer_only

        write_tokenizer_only(Path(a.tokenizer_only))
        return
    if a.write_8b:
        from tests.gguf_util import write_llama3_8b_q4km

        t = time.perf_counter()
        write_llama3_8b_q4km(Path(a.write_8b), tokenizer_from=a.tokenizer_from)
        print(f"wrote {a.write_8b} in {time.perf_counter() - t:.1f} s")
        a.model = a.model or a.write_8b

    phases: dict[str, float] = {}
    t = time.perf_counter()
    importlib.import_module("torch")

    phases["import torch"] = time.perf_counter() - t
    t = time.perf_counter()
    importlib.import_module("cli")  # what `hetero` imports before it parses the command line
    import hetero
    from hetero.app import build as loading

    phases["import hetero, cli"] = time.perf_counter() - t
    for name in ("open_checkpoint", "Tokenizer", "load_or_estimate", "load_or_measure", "make_plan", "load_from_plan",
                 "runtime_from_plan"):
        _wrap(loading, name, phases)
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
