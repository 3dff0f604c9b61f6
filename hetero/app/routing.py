"""`hetero profile-experts`: how often each expert of a mixture-of-experts model is routed to over a
set of prompts, saved where the planner finds it (`planner.experts.routing_path`): the next plan for
the model keeps the most used experts on the GPU and predicts with their share of the routed slots."""
from __future__ import annotations

from pathlib import Path

from hetero.errors import UserError
from offload.moe import count_routing
from planner.experts import routing_path, save_routing


def profile_experts(engine, prompts: list[str] | list[list[int]], out: Path | None = None,
                    ) -> tuple[Path, dict[int, list[float]], int]:
    """Prefill each prompt (plain text, no chat template; or token ids) once with `engine` and count
    the routing → (the file written, the counts, the tokens seen)."""
    if not engine.cfg.is_moe:
        raise UserError(f"{engine.info['model']} is not a mixture-of-experts model: it has no experts to profile")
    if engine.tok is None and any(isinstance(p, str) for p in prompts):
        raise UserError("profile-experts needs the model's tokenizer for text prompts")
    prompts = [p for p in prompts if (p.strip() if isinstance(p, str) else p)]
    if not prompts:
        raise UserError("no prompts: give a file with one prompt a line")
    read = count_routing(engine.runner.model)
    tokens = 0
    for text in prompts:
        ids = engine.tok.encode(text) if isinstance(text, str) else list(text)
        s = engine.sequence(ids[: engine.ctx_size - 1])
        try:
            engine.runner.prefill(s.id, s.tokens, 0)
        finally:
            engine.cache.free(s.id)
        tokens += len(s.tokens)
    counts = read()
    path = out or routing_path(engine.info["model"])
    save_routing(path, engine.info["model"], counts, len(prompts), tokens)
    return path, counts, tokens
