"""Probe: per-step decode logits of a tiny model, CUDA split paths vs the CPU float32 run."""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import hetero  # noqa: E402
from conftest import make_tiny  # noqa: E402

P = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]
d = tempfile.mkdtemp()
make_tiny(d, "llama")


def run(device, sub, graphs, gpu_tokens, embed_gpu=True):
    e = hetero.load(d, device=device, weights="f32", kv_dtype="f32", tokenizer=False, block_size=4,
                    gpu_kv_tokens=gpu_tokens, sub_batches=sub)
    if device == "cuda":
        if embed_gpu:
            e.model.embed_w = e.model.embed_w.to("cuda")
        if not graphs:
            e.runner.segments, e.runner.graphs = None, False
    r, seqs = e.runner, [0, 1]
    r.prefill(0, P, 0)
    r.prefill(1, P[::-1], 0)
    out = []
    for t in range(12):
        out.append(r.decode(seqs, [5 + t, 9 + t], [len(P) + t] * 2).float().cpu())
    return torch.stack(out)


ref = run("cpu", 1, False, 0)
for cfg in [(1, True, 5), (2, True, 5), (2, False, 5), (1, False, 5), (2, True, 0), (2, True, 5, False),
            (1, True, 1000), (2, True, 1000, False)]:
    try:
        got = run("cuda", *cfg)
        err = (got - ref).abs().amax(dim=(1, 2))
        print(cfg, "max err per step:", [f"{x:.1e}" for x in err.tolist()], "per seq:",
              [f"{x:.1e}" for x in (got - ref).abs().amax(dim=(0, 2)).tolist()])
    except Exception as ex:
        print(cfg, "ERROR", repr(ex)[:300])
