"""The Engine: sequences, a scheduler and the step loop over the model and the paged KV cache.

One step is `schedule() → run(batch) → postprocess(outputs)` (hetero/app/scheduler.py): a waiting
sequence is prefilled (in chunks) and joins the running set; otherwise every running sequence
decodes one token together. Finished sequences leave and free their KV blocks, so sequences
join and leave between steps (continuous batching).
"""
from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future
from dataclasses import replace
from typing import Iterator

import torch

from hetero.context import ContextFull, Overflow, Window, common_prefix, fit
from hetero.errors import UserError
from hetero.app.metrics import RequestStats
from hetero.model import Model
from hetero.sampling import SamplingParams
from hetero.speculative import DraftLength, RowCost, make_drafter
from hetero.app.scheduler import Chunk, Scheduler, Sequence
from hetero.tokenizer import StreamDecoder, Tokenizer
from cpu_attention import warm
from cpu_attention.linear import ROW_BY_ROW
from offload import rows
from offload.kv_cache import TieredKVCache
from offload.runner import Runner

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer | None, runner: Runner, ctx_size: int,
                 defaults: SamplingParams, info: dict | None = None, plan=None, draft: str | None = None):
        """draft: where speculative decoding's drafts come from ("ngram": prompt lookup; None: none)."""
        self.model, self.tok, self.runner = model, tokenizer, runner
        self._kernels: Future | None = None  # `load_kernels`
        self._kernels_loaded = False
        self.plan = plan  # the planner.Plan this engine carries out
        self.cache: TieredKVCache = runner.cache
        self.cfg = model.cfg
        self.ctx_size, self.defaults = ctx_size, defaults
        self.info = info or {}
        self._ids = itertools.count()
        self.last_stats = RequestStats()
        self._chat_seq: int | None = None  # the conversation whose KV stays between turns
        self._chat_tokens: list[int] = []
        self._window = Window()  # what of the conversation the model sees
        self.overflow = Overflow.DROP_TURNS
        self.drafter = make_drafter(draft)
        self.draft_cost = RowCost()  # a draft row's cost relative to a step, as measured here
        # the most rows a step with drafts may have: on the CPU, what its linears compute row by row
        # (a larger step converts each weight once for four rows, or goes through a GEMM, whose
        # float sums differ)
        self.step_rows: int | None = None if runner.cuda else ROW_BY_ROW

    # ------------------------------------------------------------------ model passes
    def _prefill(self, seq: int, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        if not self._kernels_loaded:  # a sequence's first model pass is always a prefill: once, here
            self.load_kernels().result()
            self._kernels_loaded = True
        return self.runner.prefill(seq, tokens, start, all_logits)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for each sequence → logits [B, V]."""
        return self.runner.decode([s.id for s in seqs], [s.tokens[-1] for s in seqs],
                                  [len(s.tokens) - 1 for s in seqs])

    def load_kernels(self) -> Future:
        """Numba, its settings and the host kernels loading in a background thread from now on
        (`cpu_attention.warm.load`: ~0.9 s on the 2-core machine); the first prefill waits for
        them, and starts the load itself where nobody did. `hetero chat` calls this once its prompt
        is up, so the load overlaps the typing instead of the start-up."""
        if self._kernels is None:
            self._kernels = warm.submit_load()
        return self._kernels

    @property
    def metrics(self):
        """Step timers, tokens/s, KV tokens per tier, bytes moved, swaps (`offload.timers.Metrics`)."""
        return self.runner.metrics

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] of a fresh sequence, by the engine's own path."""
        self._check_len(len(token_ids))
        seq = next(self._ids)
        try:
            return self._prefill(seq, list(token_ids), 0, all_logits=True).cpu()
        finally:
            self.cache.free(seq)

    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], **params) -> Iterator[Chunk]:
        """Stream tokens for one prompt, or for many at once (each Chunk carries its prompt's index).

        A prompt is text (tokenized as is) or token ids; params override the sampling defaults
        (max_new_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed).
        """
        p = self.defaults.update(**params)
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        seqs = [Sequence(next(self._ids), self._as_ids(x), p, index=i) for i, x in enumerate(prompts)]
        for s in seqs:
            self._check_len(len(s.tokens) + 1)
        yield from self._run(seqs, cached={})

    def sequence(self, prompt: str | list[int], ignore_eos: bool = False, **params) -> Sequence:
        """A new sequence for a `Scheduler` (the server's engine loop): its prompt checked against the context."""
        s = Sequence(next(self._ids), self._as_ids(prompt), self.defaults.update(**params), ignore_eos=ignore_eos)
        self._check_len(len(s.tokens) + 1)
        return s

    def chat(self, messages: list[dict], overflow: "str | Overflow | None" = None, **params) -> Iterator[Chunk]:
        """Answer the conversation; the KV of the previous turn is reused (only new tokens prefill).

        When the conversation outgrows the context, `overflow` (default: the engine's,
        `--context-overflow`) says what goes: the oldest turns (drop-turns), the oldest tokens
        (shift), or nothing (stop: `ContextFull` is raised). `last_stats.notes` says what went,
        and that an answer was cut by the context limit.
        """
        if self.tok is None:
            raise UserError("this engine has no tokenizer, so it cannot chat")
        p = self.defaults.update(**params)
        mode = self.overflow if overflow is None else Overflow.parse(overflow)
        stats = self.last_stats = RequestStats()
        win = self._window.follow(messages)
        answer: Sequence | None = None
        while True:
            done = [] if answer is None else answer.generated
            room = max(1, min(p.max_new_tokens - len(done), self.ctx_size // 4))
            try:
                fitted = fit(self.tok, messages, win, self.ctx_size, room, mode, done)
            except ContextFull:
                if answer is None:
                    raise
                stats.notes.append(f"the answer was cut: the {self.ctx_size}-token context is full "
                                   f"(raise -c/--ctx-size, or /clear)")
                yield replace(last, finish_reason="length")
                return
            win = self._window = fitted.window
            if fitted.note:
                stats.notes.append(fitted.note)
            seq = self._chat_sequence(fitted.tokens, p, answer)
            last = None
            try:
                for chunk in self._run([seq], cached={seq.id: self._reuse(seq)}, keep=True, stats=stats):
                    if last is not None:
                        yield last
                    last = chunk
            finally:  # an abandoned answer (Ctrl+C) too: the next turn reuses what the cache holds
                self._chat_tokens = seq.tokens[:self.cache.num_tokens(seq.id)]
            cut = seq.ctx_full and seq.finish_reason == "length" and len(seq.generated) < p.max_new_tokens
            if not cut or mode is Overflow.STOP:
                if cut:
                    stats.notes.append(f"the answer was cut: the {self.ctx_size}-token context is full "
                                       f"(/clear, raise -c/--ctx-size, or use --context-overflow drop-turns)")
                yield last
                return
            last = replace(last, finish_reason=None)  # the context moves on and the answer goes on
            answer = seq

    def _chat_sequence(self, tokens: list[int], p: SamplingParams, answer: "Sequence | None") -> Sequence:
        """The conversation's sequence; an answer cut short by the context goes on in it."""
        seq = Sequence(next(self._ids), tokens, p)
        if answer is not None:
            seq.generated, seq.sampler, seq.decoder = answer.generated, answer.sampler, answer.decoder
        return seq

    def _reuse(self, seq: Sequence) -> int:
        """Give `seq` the conversation's KV cache; → how many of its tokens are already there."""
        cached = 0
        if self._chat_seq is not None:
            cached = common_prefix(self._chat_tokens, seq.tokens)
            cached = min(cached, len(seq.tokens) - 1)  # the last prompt token must run to give logits
            self.cache.rename(self._chat_seq, seq.id)
            if cached < self.cache.num_tokens(seq.id) and not self.cache.seqs[seq.id].ordered:
                log.info("the conversation changed inside swapped KV blocks: recomputing it")
                self.cache.free(seq.id)
                cached = 0
            else:
                self.cache.truncate(seq.id, cached)
        self._chat_seq = seq.id
        return cached

    def reset_chat(self) -> None:
        if self._chat_seq is not None:
            self.cache.free(self._chat_seq)
        self._chat_seq, self._chat_tokens, self._window = None, [], Window()

    # ------------------------------------------------------------------ the step loop
    def _run(self, seqs: list[Sequence], cached: dict[int, int], keep: bool = False,
             stats: RequestStats | None = None) -> Iterator[Chunk]:
        sched = Scheduler(self, keep=keep)
        if stats is not None:  # a chat answer that goes on after the context moved keeps counting in one
            sched.stats = stats
        stats = self.last_stats = sched.stats
        for s in seqs:
            sched.add(s, cached.get(s.id, 0))
        try:
            while not sched.idle:
                for _, chunk in sched.step():
                    yield chunk
        finally:
            for s in seqs:  # an abandoned generator (Ctrl+C) frees what it held
                if not keep:
                    self.cache.free(s.id)
            stats.kv_gpu_tokens, stats.kv_host_tokens = self.cache.tier_tokens()

    def _drafts(self, s: Sequence, room: int) -> list[int]:
        """The tokens to draft after `s` this step: as many as pay at the recent acceptance rate
        (`DraftLength`) or the drafter's fixed length, within `room` (the step's rows), the answer's
        and the context's room and an exact KV rollback."""
        if s.draft is None:
            s.draft = DraftLength()
        k = self.drafter.length or s.draft.choose(self.draft_cost.relative)
        k = min(k, room, s.params.max_new_tokens - len(s.generated) - 1,
                self.ctx_size - len(s.tokens) - 1)
        k = rows.draft_room(self.cache, s.id, k)
        return self.drafter.propose(s.id, s.tokens, k) if k > 0 else []

    def _emit(self, s: Sequence, tok: int) -> Chunk:
        """`tok` is the sequence's next token: append it, see whether the sequence ends, its text."""
        s.tokens.append(tok)
        s.generated.append(tok)
        stop = self.tok.stop_ids if self.tok else frozenset(self.cfg.eos_token_ids)
        if tok in stop and not s.ignore_eos:
            s.finish_reason = "stop"
        elif len(s.generated) >= s.params.max_new_tokens or len(s.tokens) >= self.ctx_size:
            s.finish_reason = "length"
            s.ctx_full = len(s.tokens) >= self.ctx_size
        text = ""
        if self.tok is not None and (tok not in stop or s.ignore_eos):
            s.decoder = s.decoder or StreamDecoder(self.tok)
            text = s.decoder.push(tok)
        return Chunk(s.index, tok, text, s.finish_reason)

    # ------------------------------------------------------------------ helpers
    def _as_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tok is None:
                raise UserError("this engine has no tokenizer: pass token ids")
            return self.tok.encode(prompt)
        return list(prompt)

    def _check_len(self, n: int) -> None:
        if n > self.ctx_size:
            raise UserError(
                f"the prompt needs {n} tokens but the context is {self.ctx_size}: raise -c/--ctx-size "
                f"(the model allows {self.cfg.max_position_embeddings}) or shorten the prompt"
            )

    def generate_text(self, prompt: str | list[int], **params) -> str:
        return "".join(c.text for c in self.generate(prompt, **params))

