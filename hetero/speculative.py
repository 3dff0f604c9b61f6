"""Speculative decoding: drafts, their verification, and how many tokens to draft.

A drafter proposes up to k tokens to follow a sequence; one decode step runs the sequence's last
token and the drafts as consecutive rows (offload/rows.py), which gives the model's logits after
each of them for about the price of one step where the step is bound by reading weights or KV.
`accept` keeps the drafts the model agrees with and adds one token of its own, so a step yields
between 1 and k + 1 tokens.

Acceptance is the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a draft d
drawn with probability q(d) is kept with probability min(1, p(d) / q(d)), p being the sampler's
distribution (after the repetition penalty, temperature, top-k, min-p and top-p); at the first
rejection the token is drawn from max(0, p − q), renormalized; when every draft is kept one more
is drawn from p. The tokens are distributed exactly as without drafting. A prompt-lookup draft is
deterministic (q is one-hot at d): keep d with probability p(d), else draw from p without d. At
temperature 0 p is one-hot at the argmax, so the output is token for token that of plain greedy
decoding, given the same logits: a verified step's logits are plain decoding's up to float
rounding (the host tier sums a run's attention in another order: cpu_attention/decode_run.py).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from hetero.context import common_prefix
from hetero.errors import UserError
from hetero.sampling import Sampler

MAX_DRAFT = 8  # tokens a step drafts at most
DRAFTERS = ("ngram",)


class NgramDrafter:
    """Prompt lookup (llama.cpp's `--lookup`, transformers' `prompt_lookup_num_tokens`): the last n
    tokens of the sequence, n from `max_ngram` down to `min_ngram`, are looked up among its earlier
    tokens (prompt and answer); what followed their latest earlier occurrence is the draft.

    n from 3 down to 2, by measurement (`python3 -m bench.speculative --demo --ngram ...`, the demo
    model on the 2-core machine, greedy): on an answer that repeats its 2k-token context 3:2 gave
    2.03× plain decoding against 1.64× for 3:1, 1.52× for 2:1, 1.63× for 4:1 and 2.08× for 5:2; on
    free chat all were within 1.0 ± 0.06×. A single token matches too many places of a long
    context, and its drafts mostly fail while their rows cost (`DraftLength` then drafts less)."""

    length = None  # tokens a step drafts: chosen step by step (`DraftLength`)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 ≤ min ≤ max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}  # sequence id → (tokens buffer, tokens in it)

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the sequence's tokens so far, which only grow)."""
        if k <= 0:
            return []
        arr = self._tokens(seq_id, tokens)
        N = len(arr)
        for n in range(min(self.max_ngram, N - 1), self.min_ngram - 1, -1):
            tail = arr[N - n:]
            starts = np.flatnonzero(arr[: N - n] == tail[0])  # an occurrence at i is followed by arr[i + n]
            for j in range(1, n):
                starts = starts[arr[starts + j] == tail[j]]
            if starts.size:
                i = int(starts[-1]) + n
                return arr[i: i + k].tolist()
        return []

    def keep(self, sampler: Sampler, logits: torch.Tensor, drafts: list[int], history: list[int]) -> list[int]:
        return accept(sampler, logits, drafts, history)

    def forget(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)

    def _tokens(self, seq_id: int, tokens: list[int]) -> np.ndarray:
        """The tokens as an array, kept per sequence and extended by what was appended since."""
        buf, n = self._arrays.get(seq_id, (None, 0))
        if buf is None or n > len(tokens):
            buf, n = np.empty(max(64, 2 * len(tokens)), np.int64), 0
        if len(tokens) > len(buf):
            buf = np.concatenate([buf[:n], np.empty(len(tokens), np.int64)])
        buf[n: len(tokens)] = tokens[n:]
        self._arrays[seq_id] = (buf, len(tokens))
        return buf[: len(tokens)]


class FedAcceptance:
    """An acceptance fed in, for benchmarks of models whose own drafts mean nothing (random weights:
    `hetero bench --draft 3/4`): every step drafts `length` tokens and its verification keeps the
    first `kept` of them whatever the model's logits say, then adds the model's own token, as a
    step whose drafts the model agreed with `kept` times would. The step's work is the real one
    (the rows, their KV, the rollback of the rest); the text is not the model's. `length` None
    ("0/auto"): the engine's adaptive draft length chooses each step's drafts, as for a real
    drafter, and `kept` of them at most are kept ("0/auto": a drafter that is never right)."""

    def __init__(self, kept: int, length: int | None, vocab_size: int):
        if kept < 0 or (length is not None and not (kept <= length and length >= 1)):
            raise UserError(f"draft {kept}/{length}: need 0 ≤ kept ≤ drafted and drafted ≥ 1")
        self.kept, self.length, self.vocab = kept, length, vocab_size

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        return [(tokens[-1] + 1 + i) % self.vocab for i in range(k)]

    def keep(self, sampler: Sampler, logits: torch.Tensor, drafts: list[int], history: list[int]) -> list[int]:
        n = min(self.kept, len(drafts))
        return drafts[:n] + [sampler(logits[n], history + drafts[:n])]

    def forget(self, seq_id: int) -> None:
        pass


def make_drafter(name: str | None) -> NgramDrafter | None:
    if name in (None, "", "off", "none"):
        return None
    if name == "ngram":
        return NgramDrafter()
    raise UserError(f"unknown drafter {name!r}: use one of {', '.join(DRAFTERS)} (or off)")


def accept(sampler: Sampler, logits: torch.Tensor, drafts: list[int], history: list[int],
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a verified step yields (module doc): the kept prefix of `drafts` and one more.

    logits [k + 1, V]: the model's after the sequence's last token and after each draft; history:
    the sequence's tokens before the drafts (for the repetition penalty); draft_probs [k, V]: the
    distributions the drafts were drawn from (None: deterministic drafts)."""
    out: list[int] = []
    if sampler.greedy and sampler.p.repeat_penalty == 1.0:  # one argmax over the rows, on their device
        for i, tok in enumerate(torch.argmax(logits[: len(drafts) + 1], dim=-1).tolist()):
            out.append(tok)
            if i == len(drafts) or tok != drafts[i]:
                return out
    if sampler.greedy:  # p one-hot at the argmax: a draft is kept where it is the argmax, no distribution built
        for i in range(len(drafts) + 1):
            tok = sampler(logits[i], history + out if out else history)
            out.append(tok)
            if i == len(drafts) or tok != drafts[i]:
                return out
    for i, d in enumerate(drafts):
        p = sampler.distribution(logits[i], history + out)
        q = None if draft_probs is None else draft_probs[i].to(p.device)
        qd = 1.0 if q is None else float(q[d])
        pd = float(p[d])
        if pd >= qd or (pd > 0 and sampler.uniform() < pd / qd):
            out.append(d)
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0
        else:
            residual = torch.clamp(p - q, min=0)
        total = float(residual.sum())
        out.append(sampler.draw(residual / total) if total > 0 else sampler.draw(p))
        return out
    out.append(sampler(logits[len(drafts)], history + out))
    return out


@dataclass
class DraftLength:
    """How many tokens to draft: the k that maximizes the expected tokens a step yields over what
    the step costs. With a per-token acceptance rate a, a step of k drafts yields
    (1 − a^(k+1)) / (1 − a) tokens on average and costs 1 + c·k plain steps, c being a draft row's
    cost relative to a step, measured on this machine as steps run (`RowCost`)."""

    max_draft: int = MAX_DRAFT
    prior: float = 0.6  # the acceptance rate until drafts have been verified
    memory: float = 0.8  # the rate is an exponential average: the weight of the past a step
    probe_every: int = 16  # not drafting teaches nothing: after this many steps without, one token is drafted
    max_probe_every: int = 128  # ... and after each probe that keeps nothing twice as many, up to this
    rate: float = -1.0
    _idle: int = 0
    _wait: int = 0  # steps without drafts before the next probe
    _probing: bool = False

    def __post_init__(self) -> None:
        if self.rate < 0:
            self.rate = self.prior
        self._wait = self.probe_every

    def choose(self, cost: float) -> int:
        a = min(self.rate, 0.999)
        best, best_k = 1.0, 0
        for k in range(1, self.max_draft + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + cost * k)
            if gain > best * 1.02:  # a longer draft must pay by a margin
                best, best_k = gain, k
        if best_k:
            self._idle = 0
            return best_k
        self._idle += 1
        if self._idle >= self._wait:  # a probe: the rate and the row's cost are measured again
            self._idle, self._probing = 0, True
            return 1
        return 0

    def update(self, drafted: int, kept: int) -> None:
        """A verification kept `kept` of `drafted` tokens: kept successes in min(kept + 1, drafted) trials."""
        if self._probing and drafted:  # a drafter that stays wrong is probed ever more rarely
            self._probing = False
            self._wait = min(2 * self._wait, self.max_probe_every) if kept == 0 else self.probe_every
        if drafted:
            trials = min(kept + 1, drafted)
            self.rate = self.memory * self.rate + (1 - self.memory) * kept / trials


@dataclass
class RowCost:
    """A draft row's cost relative to a plain step, from the recent decode steps' wall times:
    the median time of recent one-row steps, and the median over recent longer steps of what
    each row beyond the first added to it. Medians, because a step now and then is slow for
    reasons of its own (a kernel compiling, another process), and one such step must not stop
    drafting; recent steps only, as the context and the batch change what a step costs."""

    prior: float = 0.25
    plain: deque = field(default_factory=lambda: deque(maxlen=64))  # seconds of one-row steps
    extra: deque = field(default_factory=lambda: deque(maxlen=64))  # (rows - 1, seconds) of longer steps

    def add(self, rows: float, seconds: float) -> None:
        if rows <= 1.0:
            self.plain.append(seconds)
        else:
            self.extra.append((rows - 1.0, seconds))

    @property
    def relative(self) -> float:
        if not self.plain or not self.extra:
            return self.prior
        base = statistics.median(self.plain)
        per_row = statistics.median((t - base) / n for n, t in self.extra)
        return min(1.0, max(0.0, per_row / base)) if base > 0 else self.prior


class ModelDrafter:
    """Drafts from a small model with the same vocabulary (`--draft-model PATH`), run by its own
    engine on the same device: its greedy continuation, k tokens by one prefill of what it has not
    seen and k − 1 decode steps. Greedy drafts are deterministic (q one-hot), so `accept`'s rule
    keeps the target's distribution at any temperature. The draft engine keeps each sequence's KV
    between steps, cut back to what the target kept."""

    length = None  # chosen step by step (`DraftLength`)

    def __init__(self, engine):
        self.e = engine  # a hetero Engine for the draft model
        self.seen: dict[int, list[int]] = {}  # sequence id → the tokens in the draft engine's KV

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        cache, runner = self.e.cache, self.e.runner
        # the last token runs again: its logits give the first draft
        n = common_prefix(self.seen.get(seq_id, []), tokens[:-1])
        if seq_id in cache.seqs and (n < cache.num_tokens(seq_id)):
            if cache.seqs[seq_id].ordered:
                cache.truncate(seq_id, n)
            else:  # blocks were swapped: the order of positions is lost, compute again
                cache.free(seq_id)
                n = 0
        logits = runner.prefill(seq_id, tokens, n)
        out = [int(torch.argmax(logits[-1]))]
        for i in range(1, k):
            logits = runner.decode([seq_id], [out[-1]], [len(tokens) + i - 1])
            out.append(int(torch.argmax(logits[-1])))
        self.seen[seq_id] = tokens + out[:-1]
        return out

    def keep(self, sampler: Sampler, logits: torch.Tensor, drafts: list[int], history: list[int]) -> list[int]:
        return accept(sampler, logits, drafts, history)

    def forget(self, seq_id: int) -> None:
        self.seen.pop(seq_id, None)
        self.e.cache.free(seq_id)
