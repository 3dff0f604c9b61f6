"""Speculative decoding: prompt-lookup drafts verified as runs of rows of one decode step.

Drafting changes nothing but speed: greedy tokens are those of plain decoding, the KV left after
rejected drafts is that of a run that never drafted (both tiers, every KV format), and with
sampling the distribution of a token is the model's."""
import pytest
import torch

import hetero
from conftest import rel_err
from hetero.app.scheduler import Scheduler
from hetero.errors import UserError
from hetero.sampling import Sampler, SamplingParams
from hetero.speculative import DraftLength, NgramDrafter, RowCost, accept
from offload import rows

PROMPTS = [
    [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2],
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8],  # repeats itself: drafts get kept
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 40, 41, 42],
]


def _engine(folder, draft_length=4, **kw):
    """draft_length: tokens drafted a step (fixed, so that what is drafted does not depend on timings)."""
    e = hetero.load(folder, device="cpu", weights="f32", tokenizer=False, block_size=4, **kw)
    if e.drafter is not None:
        e.drafter.length = draft_length
    return e


def _run(engine, prompt, n=24, **params):
    """Generate with KV kept afterwards (the server's scheduler, keep=True) → the sequence."""
    sched = Scheduler(engine, keep=True)
    s = engine.sequence(prompt, max_new_tokens=n, **{"temperature": 0.0, **params})
    sched.add(s)
    while not sched.idle:
        sched.step()
    return s, sched.stats


def _kv(engine, seq):
    """Every layer's K and V of a sequence, each tier's tokens as the tier holds them (float32)."""
    c = engine.cache
    s = c.seqs[seq]
    out = []
    for layer in range(engine.cfg.num_layers):
        if s.host.num_tokens:
            out += c.host.gather(layer, torch.tensor(s.host.blocks), s.host.num_tokens)
        if s.gpu.num_tokens:
            k, v = c.gpu.gather(layer, torch.tensor([s.gpu.blocks]))
            out += [k[0, :, : s.gpu.num_tokens].float(), v[0, :, : s.gpu.num_tokens].float()]
    return out


# ---------------------------------------------------------------------------- the drafter
def test_ngram_drafter_continues_the_latest_earlier_occurrence():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert d.propose(0, toks, 4) == [7, 8, 6, 1]  # "1 2 3" last seen before "7 8 6 1"
    assert d.propose(0, toks + [7], 2) == [8, 6]  # the buffer grows with the sequence
    assert d.propose(1, [1, 2, 3, 4], 3) == []  # nothing repeats
    assert d.propose(2, [4, 5, 6, 5], 3) == [6, 5]  # a 1-token match when no longer one is there
    assert d.propose(3, toks, 0) == []


def test_unknown_drafter_is_refused(tiny):
    with pytest.raises(UserError, match="unknown drafter"):
        _engine(tiny("llama")[0], draft="medusa")


# ---------------------------------------------------------------------------- acceptance
def test_greedy_acceptance_keeps_the_argmax_prefix():
    V = 6
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([2, 4, 1, 5]):  # the model's argmax after each row
        logits[i, t] = 5.0
    s = Sampler(SamplingParams(temperature=0.0))
    assert accept(s, logits, [2, 4, 1], []) == [2, 4, 1, 5]  # all kept, plus the model's next
    assert accept(s, logits, [2, 3, 1], []) == [2, 4]  # the first disagreement is replaced
    assert accept(s, logits[:1], [], []) == [2]
    # a repetition penalty sees the drafts kept before a row: 4 once kept is no longer row 1's argmax
    logits = torch.full((3, V), -5.0)
    logits[:2, 4], logits[1, 3], logits[2, 0] = 5.0, 3.0, 5.0
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    assert accept(s, logits, [4, 3], []) == [4, 3, 0]
    assert accept(s, logits, [4, 4], []) == [4, 3]


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_acceptance_keeps_the_models_distribution(with_q):
    """The first token of a step, over many seeds, is distributed as the sampler's p, whether the
    draft was p's likeliest token, an unlikely one or one p excludes (prompt lookup), or drawn
    from another distribution q (a draft model)."""
    V, n = 5, 6000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.0], [0.0, 0.3, 0.1, -0.2, 0.5]])
    params = SamplingParams(temperature=0.9, top_p=0.95)
    p = Sampler(params).distribution(logits[0], [])
    q = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1])
    for fixed in (0, 2, 4):
        counts = torch.zeros(V)
        for seed in range(n):
            sampler = Sampler(params.update(seed=seed))
            draft = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(n + seed))) if with_q else fixed
            counts[accept(sampler, logits, [draft], [], q[None] if with_q else None)[0]] += 1
        freq = counts / n
        tol = 4 * (p * (1 - p) / n).sqrt() + 1e-3  # four standard errors a token
        assert torch.all((freq - p).abs() <= tol), (fixed, freq, p)


def test_draft_length_follows_the_acceptance_rate_and_the_cost():
    d = DraftLength(max_draft=8)
    for _ in range(30):
        d.update(drafted=8, kept=8)
    assert d.choose(cost=0.05) == 8  # everything kept, rows nearly free: draft the most
    assert d.choose(cost=1.0) == 0  # a row costs a step: drafting cannot pay
    for _ in range(30):
        d.update(drafted=4, kept=0)
    assert d.choose(cost=0.05) <= 1
    # nothing kept: probes of one token, ever rarer up to max_probe_every; a kept one brings them back
    d, probes = DraftLength(rate=0.0), []
    for step in range(600):
        k = d.choose(cost=0.3)
        if k:
            probes.append(step)
        d.update(drafted=k, kept=int(step > 400) * k)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [32, 64, 128, 128]  # the first probe came after 16 steps
    assert probes[0] == 15 and gaps[-1] < 128 and d.rate > 0
    c = RowCost()
    assert c.relative == c.prior  # nothing measured yet
    for r, t in [(1, 1.0), (3, 1.2), (5, 9.0), (5, 1.4), (1, 1.0), (1, 7.0), (2, 1.1)]:  # two slow steps
        c.add(r, t)
    assert abs(c.relative - 0.1) < 1e-6  # 0.1 s a row over a 1 s step, the slow steps aside


# ---------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("kw", [
    dict(kv_dtype="f32"),
    dict(kv_dtype="bf16"),
    dict(kv_dtype="int8"),
    dict(kv_dtype="int4"),
    dict(kv_dtype="bf16", gpu_kv_tokens=8),  # both tiers: the device stand-in first
    dict(kv_dtype="int8", gpu_kv_dtype="int8", gpu_kv_tokens=8),
    dict(kv_dtype="int4", gpu_kv_dtype="int4", gpu_kv_tokens=12),
    dict(kv_dtype="int4", gpu_kv_dtype="int4", gpu_kv_tokens=1000),  # all on a quantized device tier
], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_drafting_changes_no_token_and_no_kv(tiny, kw):
    folder = tiny("llama_hd32")[0]  # head dim 32: int4's groups
    plain, spec = _engine(folder, **kw), _engine(folder, draft="ngram", **kw)
    drafted = kept = 0
    for prompt in PROMPTS:
        want, _ = _run(plain, prompt, n=28)
        got, stats = _run(spec, prompt, n=28)
        assert got.generated == want.generated
        drafted, kept = drafted + stats.drafted, kept + stats.accepted
        assert spec.cache.num_tokens(got.id) == len(got.tokens) - 1
        a, b = _kv(plain, want.id), _kv(spec, got.id)
        assert len(a) == len(b)
        # the same tokens' KV: a verified run's rows are computed together (and attend in another
        # order), so a value may round to its storage format's neighbouring step; a block sealed by
        # drafts and cut short would be off by its format's quantization error (int4: ~3e-2 here)
        tol = {"f32": 1e-6, "bf16": 2e-3, "int8": 4e-3, "int4": 1e-2}[kw.get("gpu_kv_dtype", kw["kv_dtype"])]
        for x, y in zip(a, b):
            assert x.shape == y.shape
            assert rel_err(y, x) <= tol
        for e, s in ((plain, want), (spec, got)):
            e.cache.free(s.id)
    assert drafted > kept > 0  # drafts were kept and drafts were rolled back


def test_a_drafter_never_right_changes_no_token_and_drafts_less(tiny):
    """`--draft 0/auto`: drafts of the adaptive length, none kept: the plain tokens, and after the
    first misses the engine drafts only its probes."""
    from hetero.app.bench import parse_draft

    folder = tiny("llama")[0]
    plain, spec = _engine(folder, kv_dtype="bf16"), _engine(folder, kv_dtype="bf16")
    spec.drafter = parse_draft("0/auto", spec.cfg.vocab_size)
    assert spec.drafter.length is None
    want, _ = _run(plain, PROMPTS[0], n=48)
    got, stats = _run(spec, PROMPTS[0], n=48)
    assert got.generated == want.generated
    assert stats.accepted == 0 < stats.drafted < 47 // 2  # it drafted, and most steps drafted nothing
    with pytest.raises(UserError):
        parse_draft("5/4", spec.cfg.vocab_size)


@pytest.mark.parametrize("step_rows", [8, None])  # None: no cap on a step's rows (as on CUDA)
def test_batched_drafting_matches_plain_batches(tiny, step_rows):
    folder = tiny("llama")[0]
    plain, spec = _engine(folder, kv_dtype="bf16"), _engine(folder, kv_dtype="bf16", draft="ngram")
    spec.drafter = NgramDrafter(min_ngram=1)  # 1-token matches: drafts in most steps of this random model
    spec.drafter.length = 4  # fixed: how wide a step is does not depend on timings
    spec.step_rows = step_rows
    decode, widest = spec.runner.decode, []
    spec.runner.decode = lambda seqs, *a: (widest.append(len(seqs)), decode(seqs, *a))[1]
    outs = []
    for e in (plain, spec):
        got = [[] for _ in PROMPTS]
        for c in e.generate(PROMPTS, max_new_tokens=20, temperature=0.0):
            got[c.index].append(c.token)
        outs.append(got)
        assert e.cache.tier_tokens() == (0, 0)  # finished sequences freed both tiers
    assert outs[0] == outs[1]
    assert spec.last_stats.drafted > 0
    assert max(widest) <= 8 if step_rows else max(widest) > 8  # a step's rows: within the cap, or beyond 8


def test_draft_room_never_completes_a_quantized_block(tiny):
    e = _engine(tiny("llama_hd32")[0], kv_dtype="int4")
    e.cache.reserve(7, 5)  # 5 tokens in blocks of 4: the next row is at offset 1
    assert rows.draft_room(e.cache, 7, 8) == 1  # rows at offsets 1, 2; offset 3 would complete it
    e.cache.reserve(7, 2)  # next row at offset 3: it completes the block, so no drafts
    assert rows.draft_room(e.cache, 7, 8) == 0
    f = _engine(tiny("llama_hd32")[0], kv_dtype="int8")  # per-token formats: any draft length
    f.cache.reserve(7, 7)
    assert rows.draft_room(f.cache, 7, 8) == 8


def test_demo_model_answers_the_same_with_prompt_lookup():
    """The real model, greedy: a question whose answer quotes the context, and free chat."""
    plain, spec = hetero.load(parallel=1), hetero.load(parallel=1, draft="ngram")
    doc = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
           "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")
    chats = [[{"role": "user", "content": doc + "\nRepeat the text above exactly."}],
             [{"role": "user", "content": "Write a short poem about the sea."}]]
    kept = []
    for msgs in chats:
        want = [c.token for c in plain.chat(msgs, max_new_tokens=48, temperature=0)]
        got = [c.token for c in spec.chat(msgs, max_new_tokens=48, temperature=0)]
        assert got == want
        kept.append(spec.last_stats.accepted)
        plain.reset_chat()
        spec.reset_chat()
    assert kept[0] >= 16  # the quoted answer is mostly drafted


def test_server_loop_drafts_per_request_and_counts_them(tiny):
    """The server's engine loop (continuous batching) with drafting: each request gets the tokens
    it gets alone without drafting, and the live stats and /metrics count drafted and kept tokens."""
    import queue

    from hetero.app.engine_loop import EngineLoop, Request
    from hetero.app.live import LiveStats
    from hetero.app.prom import make_registry, render

    folder = tiny("llama")[0]
    want = [_run(_engine(folder, kv_dtype="bf16"), p, n=20)[0].generated for p in PROMPTS]
    engine = _engine(folder, kv_dtype="bf16", draft="ngram", parallel=3)
    live = LiveStats({"device": "cpu"})
    loop = EngineLoop(engine, live, parallel=3, max_waiting=4)
    loop.start()
    try:
        inbox = [queue.Queue() for _ in PROMPTS]
        for p, q in zip(PROMPTS, inbox):
            loop.submit(Request(engine.sequence(p, max_new_tokens=20, temperature=0.0), q.put))
        got = []
        for q in inbox:
            toks = []
            while True:
                c = q.get(timeout=120)
                toks.append(c.token)
                if c.finish_reason is not None:
                    break
            got.append(toks)
    finally:
        loop.stop()
    assert got == want
    tot = live.totals
    assert tot.draft_tokens > tot.accepted_tokens > 0
    text = render(make_registry(live)).decode()
    assert f"hetero:spec_decode_num_draft_tokens_total {float(tot.draft_tokens)}" in text
    assert "hetero:spec_decode_draft_acceptance_rate" in text


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("prior", [0, 37, 200])
def test_a_run_of_rows_attends_like_its_rows_one_by_one(dtype, prior):
    """The host kernels over a run of k = 1..8 rows (the KV before the run read once, the rows as
    extra query heads; `cpu_attention.decode_run`) against the same kernel row by row and the
    float64 twin, over the same pool: causal among the run's own tokens, and no less exact."""
    from cpu_attention import HostKVPool, KVDtype, decode_attention, decode_attention_ref
    from test_cpu_attention import LSE_TOL
    from cpu_attention.decode import DecodeWork

    gen = torch.Generator().manual_seed(prior)
    H, G, D, BS = 2, 4, 64, 16
    for k in range(1, 9):
        n = prior + k
        pool = HostKVPool(1, -(-n // BS) + 2, H, BS, D, KVDtype(dtype))
        blocks = torch.randperm(pool.num_blocks, generator=gen)[: -(-n // BS)].tolist()
        slots = torch.tensor([blocks[t // BS] * BS + t % BS for t in range(n)])
        pool.write(0, slots, torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen))
        bt = torch.tensor([blocks] * k, dtype=torch.int32)
        lens = torch.arange(prior + 1, n + 1, dtype=torch.int32)
        q = torch.randn(k, H * G, D, generator=gen)
        assert DecodeWork(pool, bt, lens, threads=2).run_rows == (k if k > 1 else 0)
        o, lse = decode_attention(pool, 0, q, bt, lens, 0.125, threads=2)
        for r in range(k):
            args = (pool, 0, q[r:r + 1], bt[r:r + 1], lens[r:r + 1], 0.125)
            twin_o, twin_lse = decode_attention_ref(*args, dtype=torch.float64)
            row_o, row_lse = decode_attention(*args, threads=2)  # the kernel, this row alone
            kernel_err = rel_err(row_o[0], twin_o[0])  # int8/int4 round q and the value weights
            assert rel_err(o[r], twin_o[0]) <= 1.05 * kernel_err + 1e-5  # no less exact than the kernel
            assert rel_err(o[r], row_o[0]) <= 2 * kernel_err + 1e-5  # the run's own tokens are float
            assert float((lse[r] - twin_lse[0]).abs().max()) < LSE_TOL[pool.dtype]
    two = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)  # two sequences' rows: no run
    assert not DecodeWork(pool, two, torch.tensor([5, 6], dtype=torch.int32)).run_rows


@pytest.mark.parametrize("kv", ["bf16", "int4"])
def test_a_draft_model_changes_no_token(tiny, tmp_path, kv):
    """--draft-model: a tiny random model of the same vocabulary drafts; the tokens are plain
    decoding's, and its own KV follows what the model kept (free once a sequence ends)."""
    from conftest import make_tiny

    folder = tiny("llama_hd32")[0]
    make_tiny(tmp_path / "draft", "llama_hd32", seed=1)  # another model of the same shapes and vocabulary
    plain = _engine(folder, kv_dtype=kv)
    spec = hetero.load(folder, device="cpu", weights="f32", tokenizer=False, block_size=4, kv_dtype=kv,
                       draft_model=tmp_path / "draft", parallel=2)
    spec.drafter.length = 3
    for prompt in PROMPTS:
        want, _ = _run(plain, prompt, n=20)
        got, stats = _run(spec, prompt, n=20)
        assert got.generated == want.generated
        assert stats.drafted > 0
        plain.cache.free(want.id)
        spec.cache.free(got.id)
    got = [c.token for c in spec.generate(PROMPTS, max_new_tokens=12, temperature=0.0)]
    assert len(got) == 12 * len(PROMPTS)
    assert spec.drafter.e.cache.tier_tokens() == (0, 0)  # the draft engine's KV went with the sequences


def test_a_draft_model_of_another_vocabulary_is_refused(tiny, tmp_path):
    import transformers as tf

    from conftest import COMMON

    tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "vocab_size": 200})).save_pretrained(tmp_path / "v200")
    with pytest.raises(UserError, match="vocabulary"):
        hetero.load(tiny("llama")[0], device="cpu", weights="f32", tokenizer=False, draft_model=tmp_path / "v200")
    with pytest.raises(UserError, match="one source of drafts"):
        hetero.load(tiny("llama")[0], device="cpu", draft="ngram", draft_model=tmp_path / "v200")


def test_a_run_keeps_its_device_blocks_while_others_need_room():
    """A full device tier: another sequence's room in the same step is not made by swapping out the
    blocks of a sequence with a run of drafted rows, so its rollback finds its rows where they went."""
    from hetero.config import Arch, ModelConfig
    from offload.kv_cache import TieredKVCache

    cfg = ModelConfig(arch=Arch.LLAMA, vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    c = TieredKVCache(cfg, host_tokens=64, gpu_tokens=12, block_size=4, gpu_tokens_per_seq=12)
    c.reserve(1, 4)  # one full device block
    c.reserve(0, 2)  # one block, half filled: one block of the three is free
    # sequence 0's run at positions 2, 3, 4 completes its block and takes the free one; sequence 1's
    # row needs a block too: swapping out sequence 0's full block would take the run's first rows
    rows.reserve(c, [0, 0, 0, 1])
    assert c.seqs[0].swapped == 0 and c.seqs[0].gpu.num_tokens == 5
    rows.rollback(c, 0, 2)
    assert c.num_tokens(0) == 3 and c.seqs[0].gpu.num_tokens == 3 and len(c.seqs[0].gpu.blocks) == 1


def test_a_draft_model_plans_within_what_the_model_leaves_of_cpu_mem(tiny, tmp_path):
    from conftest import make_tiny

    make_tiny(tmp_path / "draft", "llama", seed=1)
    e = hetero.load(tiny("llama")[0], device="cpu", weights="f32", tokenizer=False, draft_model=tmp_path / "draft",
                    cpu_mem="1GiB")
    assert e.drafter.e.plan.budget.host_bytes == 2**30 - e.plan.memory.host_used
    with pytest.raises(UserError, match="no host memory for the draft model"):
        hetero.load(tiny("llama")[0], device="cpu", weights="f32", tokenizer=False, draft_model=tmp_path / "draft",
                    cpu_mem=e.plan.memory.host_used)


@pytest.mark.parametrize("draft", [None, "ngram"])
@pytest.mark.parametrize("gpu_kv_tokens", [28, 1000])  # 28: the device tier fills mid-answer
def test_device_tails_are_a_sequences_last_two_blocks(tiny, draft, gpu_kv_tokens):
    """The GPU's quantized attention attends bf16 tails in a split of their own that looks at each
    sequence's last two device blocks only (gpu_ops/attention_quant.py): whenever the runner reads
    the device tier's tables, no other block of a sequence is in a tail, through prefill, decode,
    runs of drafts and their rollback, batches, and a tier that fills."""
    folder = tiny("llama_hd32")[0]
    e = _engine(folder, kv_dtype="int4", gpu_kv_dtype="int4", gpu_kv_tokens=gpu_kv_tokens, parallel=3,
                **({"draft": draft} if draft else {}))
    c, seen = e.cache, []
    tables = c.tables

    def checked(seqs, tier, slots=None):
        if tier == "gpu":
            for s in seqs:
                blocks = c.seqs[s].gpu.blocks
                assert not any(c.gpu.has_tail(b) for b in blocks[:-2]), (s, blocks)
                seen.append(sum(c.gpu.has_tail(b) for b in blocks))
        return tables(seqs, tier, slots)

    c.tables = checked
    for _ in e.generate(PROMPTS, max_new_tokens=20, temperature=0.0):
        pass
    assert seen and max(seen) >= 1  # tails were there to check


def test_a_draft_model_on_the_gpu_plans_within_a_share_and_the_model_within_the_rest():
    """On the GPU the draft model plans first, within a quarter of the budgets; the model plans with
    the budgets less what the draft's plan uses, so both together stay within --gpu-mem; a draft
    that does not fit its share is refused with the reason."""
    from hetero.app.build import DRAFT_SHARE, draft_share
    from hetero.config import LLAMA3_8B
    from hetero.random_weights import SHAPES
    from planner import Budget, HardwareProfile, Workload, plan

    hw = HardwareProfile.synthetic(24, host_gib=64)
    whole = Budget(6 * 2**30, 32 * 2**30)
    ctx, parallel = 32768, 1
    small, left = draft_share(SHAPES["smollm2-135m"], hw, whole, ctx, parallel)
    m = small.memory
    assert small.device.value == "cuda" and 0 < m.gpu_used <= whole.gpu_bytes // DRAFT_SHARE
    assert left == Budget(whole.gpu_bytes - m.gpu_used, whole.host_bytes - m.host_used)
    big = plan(LLAMA3_8B, hw, left, Workload(ctx_size=ctx, batch=parallel, prompt_tokens=ctx // 2,
                                             gen_tokens=ctx - ctx // 2))
    assert big.memory.gpu_used + m.gpu_used <= whole.gpu_bytes
    assert big.memory.host_used + m.host_used <= whole.host_bytes
    with pytest.raises(UserError, match="quarter"):
        draft_share(LLAMA3_8B, hw, Budget(2 * 2**30, 4 * 2**30), ctx, parallel)
