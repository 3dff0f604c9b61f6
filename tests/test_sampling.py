import pytest
import torch

from hetero.errors import UserError
from hetero.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.0, 2.9])


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS, []) == 1


def test_seed_reproduces_and_top_k_limits():
    p = SamplingParams(temperature=1.5, top_k=3, seed=7)
    a = [Sampler(p)(LOGITS, []) for _ in range(5)]
    s = Sampler(p)
    draws = [s(LOGITS, []) for _ in range(200)]
    assert a == [Sampler(p)(LOGITS, []) for _ in range(5)]
    assert set(draws) <= {1, 2, 5} and len(set(draws)) == 3


def test_top_p_and_min_p_cut_the_tail():
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=0))
    assert {s(LOGITS, []) for _ in range(50)} == {1}
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    assert {s(LOGITS, []) for _ in range(200)} <= {1, 2, 5}


def test_repeat_penalty_discourages_seen_tokens():
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert s(LOGITS, [1]) == 5  # 3.0 / 2 < 2.9


def test_bad_parameters_raise_user_errors():
    with pytest.raises(UserError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(UserError, match="unknown sampling parameter"):
        SamplingParams().update(temprature=1.0)


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling rules over the whole vocabulary, in float64: temperature, top-k, softmax,
    min-p, top-p (the smallest likeliest prefix whose mass reaches it), renormalized."""
    x = logits.double() / p.temperature
    if p.top_k:
        x[x < torch.topk(x, min(p.top_k, len(x))).values[-1]] = float("-inf")
    probs = torch.softmax(x, -1)
    if p.min_p:
        probs[probs < p.min_p * probs.max()] = 0
    if p.top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        probs[si[sp.cumsum(0) - sp > p.top_p]] = 0
    return probs / probs.sum()


CASES = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # the chat's defaults
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=0.2, top_p=0.9),  # min-p may leave less mass than top-p
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0),
]


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_distribution_is_the_rules_over_the_whole_vocabulary(p):
    """Top-k from the k largest logits, top-p from the likeliest few hundred: the same
    probabilities as the rules applied to every token."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 4
    got = Sampler(p).distribution(logits, [])
    assert torch.allclose(got.double(), _reference(logits, p), atol=2e-6)


@pytest.mark.parametrize("p", CASES[:2] + CASES[-1:], ids=["chat", "top_p", "temperature"])
def test_draws_follow_the_distribution(p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    want, n = _reference(logits, p).float(), 4000
    s = Sampler(p.update(seed=3))
    counts = torch.bincount(torch.tensor([s(logits, []) for _ in range(n)]), minlength=12).float()
    tol = 4 * (want * (1 - want) / n).sqrt() + 1e-3  # four standard errors a token
    assert torch.all((counts / n - want).abs() <= tol), (counts / n, want)


def test_a_batch_draws_what_each_row_would_alone():
    """sample_rows (one argmax for the greedy rows, one top-k for the top-k rows) gives each row the
    token its own sampler gives it, with the same seeds."""
    from hetero.sampling import sample_rows

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(), CASES[0], SamplingParams(temperature=0, repeat_penalty=1.5), CASES[4],
              CASES[1], SamplingParams(temperature=0.9, top_k=500)]  # top-k above the vocabulary
    histories = [[], [5], [int(logits[2].argmax())], [], [7, 8], []]
    for seed in range(20):
        rows = [Sampler(p.update(seed=seed)) for p in params]
        alone = [Sampler(p.update(seed=seed))(logits[i], histories[i]) for i, p in enumerate(params)]
        assert sample_rows(rows, logits, histories) == alone


@pytest.mark.gpu
@pytest.mark.parametrize("p", CASES[:4] + [SamplingParams(temperature=0)], ids=["chat", "top_p", "min_p", "both", "greedy"])
def test_penalized_rows_sample_on_the_logits_device(p):
    """With a repetition penalty the row is sampled on its own device (no vocabulary-sized op on the
    host): on the GPU the same distribution as on the host, and the same tokens from the same seed."""
    logits = torch.randn(50000, generator=torch.Generator().manual_seed(4)) * 4
    history = torch.topk(logits, 30).indices[::3].tolist() + [0, 17]
    p = p.update(repeat_penalty=1.3, seed=11)
    host, gpu = Sampler(p), Sampler(p)
    want = host.distribution(logits, history)
    got = gpu.distribution(logits.cuda(), history)
    assert got.is_cuda and torch.allclose(got.cpu(), want, atol=1e-6)
    assert [host(logits, history) for _ in range(50)] == [gpu(logits.cuda(), history) for _ in range(50)]
