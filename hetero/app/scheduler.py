"""Continuous batching: which sequences run in the next step, and what their tokens are after it.

`schedule() → run(batch) → postprocess(outputs)` as one `step()`: a waiting sequence is
prefilled (in chunks, by the runner) and joins the running set; otherwise every running
sequence decodes one token together. Finished sequences leave and free their KV blocks, and
new ones may be added or running ones cancelled between steps, so sequences join and leave a
batch that never stops (what `Engine.generate` and the server's engine loop both drive).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetero.app.metrics import RequestStats
from hetero.sampling import Sampler, SamplingParams, sample_rows
from hetero.speculative import MAX_DRAFT, DraftLength
from hetero.tokenizer import StreamDecoder
from offload import rows

if TYPE_CHECKING:
    from hetero.app.engine import Engine


@dataclass
class Sequence:
    id: int
    tokens: list[int]  # prompt and generated tokens
    params: SamplingParams
    index: int = 0  # position in the caller's list of prompts
    prompt_len: int = 0
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # generate to max_new_tokens through EOS (benchmarks, load tests)
    ctx_full: bool = False  # it stopped because the context was full
    draft: DraftLength | None = None  # speculative decoding: how many tokens to draft for it

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.sampler = Sampler(self.params)


@dataclass(frozen=True)
class Chunk:
    """One streamed token of one sequence."""

    index: int  # which prompt it answers
    token: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS / stop token) or "length" on the last chunk


class Scheduler:
    """The waiting and running sequences of one engine; `keep`: finished sequences keep their KV (chat)."""

    def __init__(self, engine: Engine, keep: bool = False):
        self.engine, self.keep = engine, keep
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.cached: dict[int, int] = {}  # sequence id → prompt tokens whose KV is already there
        self.stats = RequestStats()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def add(self, seq: Sequence, cached: int = 0) -> None:
        self.waiting.append(seq)
        self.cached[seq.id] = cached

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is; its KV (both tiers) is freed now, between steps."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.cached.pop(seq.id, None)
        self.engine.cache.free(seq.id)

    def step(self) -> list[tuple[Sequence, Chunk]]:
        """One prefill (a waiting sequence joins) or one decode of every running sequence."""
        e, stats = self.engine, self.stats
        t0 = time.perf_counter()
        if self.waiting:  # prefill first, so new sequences join the decode batch
            s = self.waiting.pop(0)
            start = self.cached.pop(s.id, 0)
            logits = e._prefill(s.id, s.tokens, start)
            stats.add_prefill(len(s.tokens) - start, time.perf_counter() - t0)
            batch = [s]
        elif e.drafter is not None:
            return self._speculative_step(t0)
        else:
            batch, logits = list(self.running), e._decode(self.running)
            stats.add_decode(len(batch), time.perf_counter() - t0)
        # postprocess: the host draws (seeded generators), from what each row's choice needs of the logits
        toks = sample_rows([s.sampler for s in batch], logits, [s.tokens for s in batch])
        out = []
        for s, tok in zip(batch, toks):
            out.append((s, e._emit(s, tok)))
            self._settle(s)
        return out

    def _speculative_step(self, t0: float) -> list[tuple[Sequence, Chunk]]:
        """Every running sequence's last token and its drafts in one decode step (hetero/speculative.py);
        each yields the drafts the model keeps and one token more, and the rows it rejected leave the KV."""
        e, batch = self.engine, list(self.running)
        # draft rows the step may add (no limit where the linears are the same at any row count)
        room = max(0, e.step_rows - len(batch)) if e.step_rows else MAX_DRAFT * len(batch)
        drafts = []
        for s in batch:
            drafts.append(e._drafts(s, room))
            room -= len(drafts[-1])
        seqs, tokens, positions = [], [], []
        for s, d in zip(batch, drafts):
            run = [s.tokens[-1], *d]
            seqs += [s.id] * len(run)
            tokens += run
            positions += range(len(s.tokens) - 1, len(s.tokens) - 1 + len(run))
        logits = e.runner.decode(seqs, tokens, positions)
        if not all(s.sampler.greedy for s in batch):  # sampled verification weighs whole rows: one copy
            logits = logits.cpu()
        wall = time.perf_counter() - t0
        if all(len(s.generated) > 2 for s in batch):  # a sequence's first steps run slow (caches, first calls)
            e.draft_cost.add(len(seqs) / len(batch), wall)
        out, at = [], 0
        for s, d in zip(batch, drafts):
            kept = e.drafter.keep(s.sampler, logits[at: at + len(d) + 1], d, s.tokens)
            at += len(d) + 1
            emitted = 0
            for tok in kept:
                out.append((s, e._emit(s, tok)))
                emitted += 1
                if s.finish_reason is not None:
                    break
            if len(d) + 1 > emitted:  # the KV keeps the rows of the tokens now in the sequence but its last
                rows.rollback(e.cache, s.id, len(d) + 1 - emitted)
            s.draft.update(len(d), len(kept) - 1)
            self.stats.add_drafts(len(d), len(kept) - 1)
            self._settle(s)
        self.stats.add_decode(len(out), wall)
        return out

    def _settle(self, s: Sequence) -> None:
        """After a step: a sequence that goes on runs; one that finished leaves (and frees its KV)."""
        if s.finish_reason is None:
            if s not in self.running:
                self.running.append(s)
            return
        if s in self.running:
            self.running.remove(s)
        if self.engine.drafter is not None:
            self.engine.drafter.forget(s.id)
        if not self.keep:
            self.engine.cache.free(s.id)
