"""The Engine: sequences, a scheduler and the step loop over the model and the paged KV cache.

One step is `schedule() → run(batch) → postprocess(outputs)` (hetero/scheduler.py): a waiting
sequence is prefilled (in chunks) and joins the running set; otherwise every running sequence
decodes one token together. Finished sequences leave and free their KV blocks, so sequences
join and leave between steps (continuous batching).
"""
from __future__ import annotations

import itertools
import logging
from typing import Iterator

import torch

from hetero.errors import UserError
from hetero.metrics import RequestStats
from hetero.model import Model
from hetero.sampling import SamplingParams
from hetero.scheduler import Chunk, Scheduler, Sequence
from hetero.tokenizer import StreamDecoder, Tokenizer
from offload.kv_cache import TieredKVCache
from offload.runner import Runner

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer | None, runner: Runner, ctx_size: int,
                 defaults: SamplingParams, info: dict | None = None, plan=None):
        self.model, self.tok, self.runner = model, tokenizer, runner
        self.plan = plan  # the planner.Plan this engine carries out (None on the CPU-only path)
        self.cache: TieredKVCache = runner.cache
        self.cfg = model.cfg
        self.ctx_size, self.defaults = ctx_size, defaults
        self.info = info or {}
        self._ids = itertools.count()
        self.last_stats = RequestStats()
        self._chat_seq: int | None = None  # the conversation whose KV stays between turns
        self._chat_tokens: list[int] = []

    # ------------------------------------------------------------------ model passes
    def _prefill(self, seq: int, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        return self.runner.prefill(seq, tokens, start, all_logits)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for each sequence → logits [B, V]."""
        return self.runner.decode([s.id for s in seqs], [s.tokens[-1] for s in seqs],
                                  [len(s.tokens) - 1 for s in seqs])

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

    def chat(self, messages: list[dict], **params) -> Iterator[Chunk]:
        """Answer the conversation; the KV of the previous turn is reused (only new tokens prefill)."""
        if self.tok is None:
            raise UserError("this engine has no tokenizer, so it cannot chat")
        tokens = self.tok.apply_chat_template(messages)
        self._check_len(len(tokens) + 1)
        p = self.defaults.update(**params)
        seq = Sequence(next(self._ids), tokens, p)
        cached = 0
        if self._chat_seq is not None:
            cached = _common_prefix(self._chat_tokens, tokens)
            cached = min(cached, len(tokens) - 1)  # the last prompt token must run to give logits
            self.cache.rename(self._chat_seq, seq.id)
            if cached < self.cache.num_tokens(seq.id) and not self.cache.seqs[seq.id].ordered:
                log.info("the conversation changed inside swapped KV blocks: recomputing it")
                self.cache.free(seq.id)
                cached = 0
            else:
                self.cache.truncate(seq.id, cached)
        self._chat_seq = seq.id
        yield from self._run([seq], cached={seq.id: cached}, keep=True)
        self._chat_tokens = seq.tokens[:self.cache.num_tokens(seq.id)]

    def reset_chat(self) -> None:
        if self._chat_seq is not None:
            self.cache.free(self._chat_seq)
        self._chat_seq, self._chat_tokens = None, []

    # ------------------------------------------------------------------ the step loop
    def _run(self, seqs: list[Sequence], cached: dict[int, int], keep: bool = False) -> Iterator[Chunk]:
        sched = Scheduler(self, keep=keep)
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

    def _sample(self, s: Sequence, logits: torch.Tensor) -> Chunk:
        tok = s.sampler(logits, s.tokens)
        s.tokens.append(tok)
        s.generated.append(tok)
        stop = self.tok.stop_ids if self.tok else frozenset(self.cfg.eos_token_ids)
        if tok in stop and not s.ignore_eos:
            s.finish_reason = "stop"
        elif len(s.generated) >= s.params.max_new_tokens or len(s.tokens) >= self.ctx_size:
            s.finish_reason = "length"
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
