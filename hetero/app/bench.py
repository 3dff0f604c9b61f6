"""`hetero bench`: llama-bench-shaped figures through the engine path chat and serve use.

For every combination of host KV dtype, batch (`--parallel`) and depth, the engine is loaded
as `hetero.load` would load it (the planner's plan on CUDA), and each repetition runs, through
the `Scheduler` the server drives: `batch` sequences of `depth + n_prompt` random tokens, the
first `depth` tokens prefilled untimed (the context already there), then the `n_prompt` tokens
prefilled (pp, timed) and `n_gen` tokens decoded by the whole batch together (tg, timed).
One warm-up repetition runs first (kernels compile, CUDA graphs capture). Rows give t/s as
mean ± sample standard deviation over the repetitions, and the plan each ran with.

Speculative decoding (`--draft`, a column): "ngram" drafts by prompt lookup as `hetero chat
--draft ngram` does (over random tokens it finds little: what drafting costs when nothing is
kept); "A/K" feeds the acceptance in, for random weights: each step drafts K tokens and its
verification keeps A of them (`hetero.speculative.FedAcceptance`).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from hetero.app.engine import Engine
from hetero.errors import UserError
from hetero.app.scheduler import Scheduler
from hetero.speculative import FedAcceptance, make_drafter

log = logging.getLogger(__name__)


@dataclass
class BenchRow:
    model: str
    params: int
    device: str
    weights: str
    kv_dtype: str
    n_batch: int
    n_depth: int
    n_prompt: int
    n_gen: int
    test: str  # "pp512", "tg128", "tg128 @ d8192" (llama-bench's names)
    avg_ts: float
    stddev_ts: float
    samples_ts: list[float] = field(default_factory=list)
    plan: str = ""
    predicted_ts: float | None = None  # the planner's decode prediction (tg rows on CUDA)
    draft: str = "off"  # speculative decoding: off, ngram, or a fed-in acceptance "A/K"
    acceptance: float | None = None  # drafted tokens kept (tg rows with drafts)


@dataclass(frozen=True)
class BenchSpec:
    n_prompt: int = 512
    n_gen: int = 128
    depths: tuple[int, ...] = (0,)
    reps: int = 3
    batches: tuple[int, ...] = (1,)
    kv_dtypes: tuple[str | None, ...] = (None,)  # None: the planner's choice (bf16 on the CPU)
    drafts: tuple[str, ...] = ("off",)

    def __post_init__(self) -> None:
        for d in self.drafts:
            parse_draft(d, vocab_size=2)
        if self.n_prompt < 0 or self.n_gen < 0 or self.n_prompt + self.n_gen == 0:
            raise UserError("-p and -n must be ≥ 0 and not both 0")
        if self.reps < 1 or min(self.batches) < 1 or min(self.depths) < 0:
            raise UserError("-r and -b must be ≥ 1, -d ≥ 0")


def run_bench(load: Callable[..., Engine], spec: BenchSpec, on_row: Callable[[BenchRow], None] | None = None,
              seed: int = 0) -> list[BenchRow]:
    """load(kv_dtype=, parallel=, ctx_size=) → Engine (hetero.load with the user's other options)."""
    rows: list[BenchRow] = []
    ctx = max(spec.depths) + max(spec.n_prompt, 1) + spec.n_gen + 1
    for kv in spec.kv_dtypes:
        for batch in spec.batches:
            engine = load(kv_dtype=kv, parallel=batch, ctx_size=ctx)
            try:
                for draft in spec.drafts:
                    engine.drafter = parse_draft(draft, engine.cfg.vocab_size)
                    # warm-up: compiles, graph captures, allocations, a draft length settling
                    _measure(engine, spec, batch, 0, min(spec.n_gen, 16), seed)
                    for depth in spec.depths:
                        pp, tg, kept = [], [], []
                        for r in range(spec.reps):
                            a, b, c = _measure(engine, spec, batch, depth, spec.n_gen, seed + r)
                            pp.append(a)
                            tg.append(b)
                            kept.append(c)
                        for row in _rows(engine, spec, batch, depth, pp, tg, draft, kept):
                            rows.append(row)
                            if on_row is not None:
                                on_row(row)
            finally:
                engine.runner.close()
    return rows


def parse_draft(text: str, vocab_size: int):
    """A `--draft` value → the engine's drafter: off → None, ngram, or "A/K" (fed-in acceptance; K
    "auto": the engine's adaptive draft length, at most A kept)."""
    if "/" in text:
        kept, length = text.split("/", 1)
        try:
            return FedAcceptance(int(kept), None if length == "auto" else int(length), vocab_size)
        except ValueError:
            raise UserError(f"--draft {text!r}: give off, ngram or KEPT/DRAFTED (e.g. 3/4, 0/auto)") from None
    return make_drafter(text)


def _measure(engine: Engine, spec: BenchSpec, batch: int, depth: int, n_gen: int,
             seed: int) -> tuple[float, float, float | None]:
    """(prompt tokens/s, generated tokens/s, drafted tokens kept or None) of one repetition."""
    n_prompt = max(spec.n_prompt, 1)
    gen = torch.Generator().manual_seed(seed)
    sched = Scheduler(engine)
    seqs = []
    for _ in range(batch):
        ids = torch.randint(0, engine.cfg.vocab_size, (depth + n_prompt,), generator=gen).tolist()
        s = engine.sequence(ids, ignore_eos=True, max_new_tokens=n_gen + 1, temperature=0.0)
        if depth:
            engine.runner.prefill(s.id, ids[:depth], 0)  # the context already there: not timed
        sched.add(s, cached=depth)
        seqs.append(s)
    if engine.runner.cuda:
        torch.cuda.synchronize()  # the untimed context's prefill (and its KV copies) ends before the clock starts
    prefill_s = decode_s = 0.0
    decoded = 0
    try:
        while not sched.idle:
            prefill = bool(sched.waiting)
            t0 = time.perf_counter()
            out = sched.step()
            dt = time.perf_counter() - t0
            if prefill:
                prefill_s += dt
            else:
                decode_s += dt
                decoded += len(out)
    finally:
        for s in seqs:
            engine.cache.free(s.id)
    kept = sched.stats.accepted / sched.stats.drafted if sched.stats.drafted else None
    return batch * n_prompt / prefill_s, decoded / decode_s if decode_s else 0.0, kept


def _rows(engine: Engine, spec: BenchSpec, batch: int, depth: int, pp: list[float], tg: list[float],
          draft: str = "off", kept: list[float | None] | None = None) -> list[BenchRow]:
    from planner.tensors import total_params

    info = engine.info
    plan = info.get("plan") or info.get("kv_tiers", "")
    predicted = engine.plan.prediction.decode_tok_s if engine.plan is not None else None
    kv = engine.plan.kv.host_dtype.value if engine.plan is not None else info.get("kv_dtype", "")
    at = f" @ d{depth}" if depth else ""
    base = dict(model=str(info.get("model", "")).rsplit("/", 1)[-1], params=total_params(engine.cfg),
                device=info.get("device", ""), weights=info.get("weights", ""), kv_dtype=kv, n_batch=batch,
                n_depth=depth, plan=plan)
    out = []
    if spec.n_prompt and draft == spec.drafts[0]:  # a prompt's prefill drafts nothing: one pp row
        out.append(BenchRow(**base, n_prompt=spec.n_prompt, n_gen=0, test=f"pp{spec.n_prompt}{at}", **_stats(pp)))
    if spec.n_gen:
        rates = [k for k in kept or [] if k is not None]
        out.append(BenchRow(**base, n_prompt=0, n_gen=spec.n_gen, test=f"tg{spec.n_gen}{at}", **_stats(tg),
                            predicted_ts=predicted, draft=draft,
                            acceptance=statistics.fmean(rates) if rates else None))
    return out


def _stats(xs: list[float]) -> dict:
    return dict(avg_ts=statistics.fmean(xs), stddev_ts=statistics.stdev(xs) if len(xs) > 1 else 0.0,
                samples_ts=list(xs))


# ---------------------------------------------------------------------- output
COLUMNS = ["model", "params", "device", "weights", "kv_dtype", "n_batch", "draft", "test", "t/s", "plan"]


def render(rows: list[BenchRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([asdict(r) for r in rows], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(asdict(rows[0]).keys()) if rows else ["model"])
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d["samples_ts"] = ";".join(f"{x:.3f}" for x in r.samples_ts)
            w.writerow(d)
        return buf.getvalue().rstrip("\n")
    if fmt == "md":
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if c in ("params", "n_batch", "t/s")
                                                                else "---" for c in COLUMNS) + "|"]
        for r in rows:
            draft = r.draft if r.acceptance is None else f"{r.draft} ({r.acceptance:.0%} kept)"
            cells = [r.model, _params(r.params), r.device, r.weights, r.kv_dtype, str(r.n_batch), draft, r.test,
                     f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}", r.plan]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    raise UserError(f"-o {fmt!r} is not one of md, json, csv")


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def parse_list(text: str, what: str) -> tuple[int, ...]:
    """"0,8192,32768" → (0, 8192, 32768); a clear error otherwise."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{what} {text!r}: give whole numbers separated by commas (e.g. 0,8192)") from None
    if not out:
        raise UserError(f"{what} is empty: give at least one number")
    return out
