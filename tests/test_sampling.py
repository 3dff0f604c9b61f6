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
