"""Chat keeps its KV between turns: the second turn prefills only its new tokens, same answer."""
import pytest

import hetero


@pytest.fixture(scope="module")
def e():
    engine = hetero.load(weights="f32", kv_dtype="f32")
    yield engine
    engine.reset_chat()


def _tokens(stream):
    return [c.token for c in stream]


def test_second_turn_prefills_only_new_tokens_and_matches_fresh_run(e):
    e.reset_chat()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = list(e.chat(msgs, temperature=0.0, max_new_tokens=40))
    assert first[-1].finish_reason == "stop"  # the answer ended on the template's end-of-turn token
    cached = len(e._chat_tokens)
    msgs += [{"role": "assistant", "content": "".join(c.text for c in first)},
             {"role": "user", "content": "And what is the capital of Italy?"}]
    full = e.tok.apply_chat_template(msgs)
    reused = _tokens(e.chat(msgs, temperature=0.0, max_new_tokens=24))
    assert e.last_stats.prompt_tokens == len(full) - cached < len(full) // 2

    e.reset_chat()
    fresh = _tokens(e.chat(msgs, temperature=0.0, max_new_tokens=24))
    assert e.last_stats.prompt_tokens == len(full)
    assert reused == fresh


def test_edited_history_recomputes_from_the_divergence(e):
    e.reset_chat()
    a = [{"role": "user", "content": "Name a color."}]
    list(e.chat(a, temperature=0.0, max_new_tokens=8))
    b = [{"role": "user", "content": "Name a fruit."}]
    out = _tokens(e.chat(b, temperature=0.0, max_new_tokens=8))
    e.reset_chat()
    assert out == _tokens(e.chat(b, temperature=0.0, max_new_tokens=8))


def test_the_first_pass_waits_for_the_kernel_load_and_raises_its_failure():
    from concurrent.futures import Future

    engine = hetero.load(weights="f32", kv_dtype="f32", tokenizer=False)
    failed = Future()
    failed.set_exception(RuntimeError("the kernels did not load"))
    engine._kernels = failed  # as if `load_kernels` had started a load that then failed
    with pytest.raises(RuntimeError, match="did not load"):
        list(engine.generate([1, 2, 3], max_new_tokens=1))
    engine._kernels = None
    assert engine.load_kernels() is engine.load_kernels()  # one load
    assert len(list(engine.generate([1, 2, 3], max_new_tokens=2, temperature=0.0))) == 2
