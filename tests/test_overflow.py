"""A conversation that outgrows the context goes on: the oldest turns go (or the context shifts),
what remains reuses its KV, and a dim line says so; piped chats run to their last line and
honour slash commands."""
import pytest
from typer.testing import CliRunner

import hetero
from cli import app

QUESTIONS = [f"Name a fruit that starts with the letter {c}." for c in "ABCDEFGHIJKLMNOPRSTUVWXYZ"] * 2


def chat(*args, input):
    r = CliRunner().invoke(app, ["chat", "-t", "1", *args], input=input)
    assert "Traceback" not in r.output
    return r


def test_piped_chat_outlives_the_context():
    r = chat("-c", "512", "-n", "8", "--temp", "0", input="".join(q + "\n" for q in QUESTIONS[:40]))
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) >= 40  # each answer ends its own line: all 40 were answered
    assert "dropped the" in r.stderr and "512-token context" in r.stderr


def test_stop_says_why_it_stopped():
    r = chat("-c", "512", "-n", "8", "--temp", "0", "--context-overflow", "stop",
             input="".join(q + "\n" for q in QUESTIONS[:40]))
    assert r.exit_code == 2
    assert "context is 512" in r.output and "--context-overflow drop-turns" in r.output
    assert 3 < len(r.stdout.splitlines()) < 40


def test_piped_slash_commands_and_blocks():
    greedy = chat("-n", "16", "--temp", "0", input="What is the capital of France?\n")
    assert greedy.exit_code == 0
    r = chat("-n", "16", input='/set parameter temperature abc\n/set parameter temperature 0\n'
                               '"""\nWhat is the capital\nof France?\n"""\n/bye\nnever asked\n')
    assert r.exit_code == 0
    assert "temperature" in r.stderr and "abc" in r.stderr and "≥ 0" in r.stderr
    multi = r.stdout
    r = chat("-n", "16", input="/set parameter temperature 0\nWhat is the capital of France?\n")
    assert r.stdout == greedy.stdout and "Paris" in r.stdout
    assert "Paris" in multi  # the block was one message, answered; "never asked" came after /bye


@pytest.fixture(scope="module")
def e():
    return hetero.load(ctx_size=256, threads=1)


def _converse(e, n, overflow, max_new_tokens=24):
    e.reset_chat()
    msgs, notes = [], []
    for q in QUESTIONS[:n]:
        msgs.append({"role": "user", "content": q})
        toks = [c.token for c in e.chat(msgs, overflow=overflow, temperature=0, max_new_tokens=max_new_tokens)]
        notes += e.last_stats.notes
        msgs.append({"role": "assistant", "content": e.tok.decode(toks)})
    return msgs, notes


def test_greedy_answer_after_a_drop_equals_a_fresh_run_over_the_kept_turns(e):
    msgs, notes = _converse(e, 10, "drop-turns")
    assert any("dropped the" in n for n in notes)
    msgs.append({"role": "user", "content": "Which of those is the sweetest?"})
    before = e._window.skip
    after = [c.token for c in e.chat(msgs, temperature=0, max_new_tokens=24)]
    kept = msgs[e._window.skip:]
    assert e._window.skip >= before > 0 and kept[0]["role"] == "user"
    assert e.last_stats.prompt_tokens < len(e.tok.apply_chat_template(kept))  # the kept turns' KV was reused
    e.reset_chat()
    assert [c.token for c in e.chat(kept, temperature=0, max_new_tokens=24)] == after


def test_shift_keeps_the_system_prompt_and_goes_on(e):
    msgs, notes = _converse(e, 10, "shift")
    assert any("shifted the context" in n for n in notes)
    head = e.tok.apply_chat_template(msgs[:1])[:10]
    assert e._chat_tokens[:10] == head  # the template's system prompt is still first


def test_an_answer_cut_by_the_context_says_so(e):
    e.reset_chat()
    words = "Repeat these words:"
    while len(e.tok.apply_chat_template([{"role": "user", "content": words}])) < 250:
        words += " apple banana"
    chunks = list(e.chat([{"role": "user", "content": words}], overflow="stop", temperature=0, max_new_tokens=400))
    assert chunks[-1].finish_reason == "length" and len(e._chat_tokens) <= 256
    assert any("the answer was cut" in n for n in e.last_stats.notes)
