"""The benchmarks, by name: `python3 -m bench.run` lists them, `python3 -m bench.run NAME [ARGS...]`
runs one with ARGS passed through (`python3 -m bench.run NAME --help` for its options).

Run from the repository root. End-to-end figures of a model as a user runs it come from
`hetero bench` (llama-bench-style rows through the engine); these scripts measure what the
figures in bench/RESULTS.md need: each prints its figure beside the bound it is measured against.
`bench/device_run.sh` runs several of them in one call on a GPU host.
"""
from __future__ import annotations

import importlib
import sys

# name: (what it measures, where it runs); the module is bench.NAME
BENCHMARKS: dict[str, tuple[str, str]] = {
    "budget": ("decode of the Llama-3-8B shape at a GPU memory budget, the planner's own choice, against the "
               "bytes-over-bandwidth bound", "GPU"),
    "moe": ("mixture-of-experts decode and prefill (Qwen3-30B-A3B, Mixtral-8x7B shapes) at GPU memory budgets, "
            "the planner's own choice, against the HBM / DRAM bound", "GPU"),
    "offload_decode": ("decode with the KV on the host (and split), the engine's timers per step, against the "
                       "HBM / DRAM bound", "GPU"),
    "gpu_decode": ("all-GPU decode and prefill with NF4 weights, and each NF4 kernel per linear shape, against "
                   "HBM and matmul bounds", "GPU"),
    "gpu_kv_attention": ("paged decode attention over bf16 / int8 / int4 device blocks, KV GB/s against the HBM "
                         "copy rate", "GPU"),
    "nf4_mma": ("the NF4 tensor-core matmul at 4-64 rows: checked, swept, timed against HBM and bitsandbytes", "GPU"),
    "nf4_gemv": ("the NF4 matrix-vector kernels at 1-8 rows: checked, timed against HBM and bitsandbytes", "GPU"),
    "nf4_tc_probe": ("where the tensor-core NF4 GEMV's time goes: variants that leave one stage out, against a "
                     "plain read of the same bytes and the HBM copy rate", "GPU"),
    "cpu_attention": ("host decode attention (Numba) over bf16 / int8 / int4 blocks, KV GB/s against the DRAM "
                      "read rate", "CPU"),
    "cpu_decode": ("CPU-only decode of the demo model: tok/s, weight and KV GB/s against the DRAM read rate",
                   "CPU"),
    "sampling": ("what choosing a token costs the host at 49k-152k vocabularies, and the demo model's chat with "
                 "the chat's default sampling against the same chat greedy", "CPU"),
    "weight_accuracy": ("weight formats (NF4, the linear q4, int8) on the demo model: argmax agreement with bf16 "
                        "weights, KL and perplexity", "CPU"),
    "kv_accuracy": ("quantized host KV on the demo model: argmax agreement with bf16 KV and perplexity", "CPU"),
    "startup": ("where `hetero chat`'s start-up time goes: imports, tokenizer, plan, weights, KV cache, first "
                "token", "CPU or GPU"),
    "speculative": ("speculative decoding at long context (Llama-3-8B shape, the planner's placement): tok/s with "
                    "drafts off, fed-in acceptances and prompt lookup, against (kept + 1) plain steps", "GPU or CPU"),
    "omp_pools": ("what a second OpenMP pool (Numba's or torch's) costs three small Numba parallel regions, "
                  "against the regions alone", "CPU"),
    "experts_pool": ("the host experts' call through its C entry point: OpenMP's kernel against the experts' own "
                     "pool of spinning threads, µs a call against the DRAM read rate (--chunks: the pool's claim "
                     "size, --dram: the rate by threads)", "CPU"),
    "serve_load": ("a bounded load run against `hetero serve`: requests, errors, server memory", "CPU"),
    "moe_grouped": ("the MoE prefill's grouped 4-bit GEMM on Qwen3-30B-A3B's shapes, µs a call against the HBM / "
                    "tensor-core bound, and a sweep of its launch configurations", "GPU"),
    "dram_share": ("the CPU's expert kernel and the GPU's reads of page-locked memory, alone and at once, against "
                   "the DRAM read rate", "GPU"),
    "stream_copies": ("a decode layer's streamed host KV going up: one driver call a piece, one batched call, a "
                      "kernel reading pinned memory, against one contiguous copy; alone and beside a DRAM load", "GPU"),
}


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: python3 -m bench.run NAME [ARGS...]   (NAME --help: its options)", "",
             "End-to-end figures of a model: `hetero bench MODEL` (see `hetero bench --help`).", ""]
    lines += [f"  {name:{width}}  {where:10}  {what}" for name, (what, where) in BENCHMARKS.items()]
    return "\n".join(lines)


def run(name: str, args: list[str]) -> None:
    """bench.NAME's main(), its command line ARGS (as `python3 -m bench.NAME ARGS...` would run it)."""
    module = importlib.import_module(f"bench.{name}")
    sys.argv = [f"python3 -m bench.{name}", *args]  # argparse's usage line names it so
    module.main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"no benchmark named {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    run(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
