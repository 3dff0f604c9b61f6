"""Sampling: repetition penalty, temperature, top-k, top-p, min-p, seeded; greedy at temperature 0."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from hetero.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        for name, (kind, ok, allowed) in RANGES.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise UserError(f"{name} {v} is out of range: use {allowed}")

    def update(self, **changes) -> "SamplingParams":
        known = {f.name for f in fields(self)}
        bad = set(changes) - known
        if bad:
            raise UserError(f"unknown sampling parameter(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(known))}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# name → (type, check, the valid values in words), for messages and `/set parameter`
RANGES = {
    "temperature": (float, lambda v: v >= 0, "a number ≥ 0 (0 = greedy)"),
    "top_k": (int, lambda v: v >= 0, "a whole number ≥ 0 (0 = off)"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "min_p": (float, lambda v: 0 <= v < 1, "a number in [0, 1) (0 = off)"),
    "repeat_penalty": (float, lambda v: v > 0, "a number > 0 (1 = off)"),
    "seed": (int, lambda v: v >= 0, "a whole number ≥ 0"),
    "max_new_tokens": (int, lambda v: v >= 1, "a whole number ≥ 1"),
}


def parse_param(name: str, text: str) -> float | int:
    """A sampling parameter typed as text (`/set parameter NAME VALUE`) → its value, checked."""
    if name not in RANGES:
        raise UserError(f"unknown parameter {name!r}; known: {', '.join(RANGES)}")
    kind, ok, allowed = RANGES[name]
    try:
        v = kind(text)
    except ValueError:
        raise UserError(f"{name} {text!r} is not valid: use {allowed}") from None
    if not ok(v):
        raise UserError(f"{name} {text} is out of range: use {allowed}")
    return v


def defaults_from_generation_config(folder: Path | None) -> SamplingParams:
    """The model's own defaults (generation_config.json), else greedy-free llama.cpp-like ones."""
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    gen = None if folder is None else folder / "generation_config.json"
    if gen is None or not gen.is_file():
        return p
    g = json.loads(gen.read_text())
    if g.get("do_sample") is False:
        p = p.update(temperature=0.0)
    return p.update(
        temperature=g.get("temperature") if g.get("do_sample", True) else None,
        top_k=g.get("top_k"),
        top_p=g.get("top_p"),
        min_p=g.get("min_p"),
        repeat_penalty=g.get("repetition_penalty"),
    )


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits [V] float32, on any device → the next token id. Only what the choice needs comes
        to the host: the argmax when greedy; with top-k on (and no repetition penalty), the k
        candidates, drawn from as `distribution` weighs them; otherwise the token drawn. The
        vocabulary-sized work stays on the logits' device: on the host, each of torch's ops over a
        row that long opens an OpenMP region, whose spinning workers then take the cores the host's
        own kernels (experts, attention) run on between steps."""
        if self.greedy:  # the argmax itself, no distribution built (nor a copy, without a penalty)
            return int(torch.argmax(self._penalized(logits, history) if self.penalizes(history) else logits))
        if self.p.top_k > 0 and not self.penalizes(history):
            return self.pick(*torch.topk(logits, min(self.p.top_k, logits.numel())))
        return self.draw(self.distribution(logits, history))

    def pick(self, vals: torch.Tensor, ids: torch.Tensor) -> int:
        """A token from the k largest logits (vals [k] in descending order, their ids [k]; any
        device), drawn as `distribution` weighs them (no repetition penalty)."""
        probs, ids = self._candidates(vals, ids)
        return int(ids[torch.multinomial(probs, 1, generator=self.gen)])

    def penalizes(self, history: list[int]) -> bool:
        return self.p.repeat_penalty != 1.0 and bool(history)

    @property
    def greedy(self) -> bool:
        return self.p.temperature == 0

    def _penalized(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """A float32 copy of logits, on their device, with the repetition penalty applied to the
        tokens in history."""
        p = self.p
        logits = logits.float().clone()
        if self.penalizes(history):
            ids = torch.tensor(sorted(set(history)), dtype=torch.long).to(logits.device)
            v = logits[ids]
            logits[ids] = torch.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        return logits

    def distribution(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """logits [V] → the probabilities the next token is drawn from [V] float32 on the logits'
        device (after the repetition penalty, temperature, top-k, min-p and top-p; one-hot at the
        argmax when greedy)."""
        p = self.p
        logits = self._penalized(logits, history)
        if p.temperature == 0:
            return torch.nn.functional.one_hot(torch.argmax(logits), logits.numel()).float()
        if p.top_k > 0:
            probs, ids = self._candidates(*torch.topk(logits, min(p.top_k, logits.numel())))
            dev = logits.device
            return torch.zeros(logits.numel(), device=dev).index_copy_(0, ids.to(dev), probs.to(dev))
        return self._cut(torch.softmax(logits / p.temperature, dim=-1), ranked=False)

    def _candidates(self, vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k: the k largest logits (descending) and their ids, any device → (probabilities [k]
        float32, token ids [k]) on the host. A softmax over the k alone is the whole row's with the
        rest at −inf, and the host sorts k numbers for top-p instead of V (a 128k vocabulary: 7.2 →
        0.3 ms a token on two cores)."""
        probs = torch.softmax(vals.float().cpu() / self.p.temperature, dim=-1)
        return self._cut(probs, ranked=True), ids.cpu()

    def _cut(self, probs: torch.Tensor, ranked: bool) -> torch.Tensor:
        """min-p and top-p on probabilities (`ranked`: already in descending order), renormalized."""
        p = self.p
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        if p.top_p < 1.0 and float(probs.sum()) > p.top_p:  # (min-p may have left less mass than top-p)
            sp, si = (probs, None) if ranked else _nucleus_candidates(probs, p.top_p)
            drop = sp.cumsum(0) - sp > p.top_p  # keep the smallest prefix whose mass reaches top_p
            if si is None:
                probs[drop] = 0
            else:
                kept = si[~drop]
                probs = torch.zeros_like(probs).index_copy_(0, kept, probs[kept])
        return probs / probs.sum()

    def draw(self, probs: torch.Tensor) -> int:
        """A token from probabilities [V] on any device (the argmax when greedy: no random number is
        used): the first whose cumulative probability exceeds one uniform draw from this sampler's
        generator (V exponential draws, as torch.multinomial takes them, cost 1-2 ms a token at a
        128k vocabulary)."""
        if self.greedy:
            return int(torch.argmax(probs))
        c = probs.cumsum(0)
        u = torch.rand(1, generator=self.gen).to(c.device)
        i = int(torch.searchsorted(c, u * c[-1], right=True))
        return i if i < len(c) and probs[i] > 0 else int(torch.nonzero(probs)[-1])  # rounding at the very end

    def uniform(self) -> float:
        """A number in [0, 1) from this sampler's generator (speculative acceptance)."""
        return float(torch.rand(1, generator=self.gen))


def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The likeliest tokens, in descending order (probabilities, ids), enough of them to hold
    top_p of the mass: the largest 64, 256, ... until they do, instead of sorting the whole
    vocabulary (14 ms a token at 128k on two cores)."""
    m = 64
    while True:
        sp, si = torch.topk(probs, min(m, probs.numel()))
        if float(sp.sum()) >= top_p or m >= probs.numel():
            return sp, si
        m *= 4


def sample_rows(samplers: list[Sampler], logits: torch.Tensor, histories: list[list[int]]) -> list[int]:
    """One token for each row of logits [B, V] (any device), with as few copies to the host as the
    rows allow: the rows whose sampler takes the argmax alone (greedy, no penalty) by one argmax
    over them; the rows drawn from their top-k (no penalty) from one `torch.topk` of the largest k
    among them; each other row through its sampler."""
    B, V = logits.shape
    argmax, top, rest = [], [], []
    for i, (s, h) in enumerate(zip(samplers, histories)):
        (rest if s.penalizes(h) else argmax if s.greedy else top if s.p.top_k > 0 else rest).append(i)
    toks = [0] * B
    if argmax:
        rows = logits if len(argmax) == B else logits[argmax]
        for i, t in zip(argmax, torch.argmax(rows, dim=-1).tolist()):
            toks[i] = t
    if top:
        vals, ids = torch.topk(logits if len(top) == B else logits[top], min(V, max(samplers[i].p.top_k for i in top)))
        vals, ids = vals.cpu(), ids.cpu()
        for j, i in enumerate(top):
            k = min(V, samplers[i].p.top_k)
            toks[i] = samplers[i].pick(vals[j, :k], ids[j, :k])
    for i in rest:
        toks[i] = samplers[i](logits[i], histories[i])
    return toks
