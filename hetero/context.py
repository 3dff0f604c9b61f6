"""What a conversation keeps when it outgrows the context (`--context-overflow`).

drop-turns (the default, Ollama's habit): the oldest exchanges (a user message and its answer)
go; the system message and the current question stay. shift (llama-cli's context shift): the
oldest tokens after the system prompt go, wherever they cut. stop: nothing goes; the caller is
told why the conversation cannot go on.

A cut is made generously, down to half the context, so the turns after it reuse the KV cache
again (only their new tokens prefill) until the next overflow.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Protocol

from hetero.errors import UserError


class Overflow(str, enum.Enum):
    DROP_TURNS = "drop-turns"
    SHIFT = "shift"
    STOP = "stop"

    @classmethod
    def parse(cls, value: "str | Overflow") -> "Overflow":
        try:
            return cls(value)
        except ValueError:
            raise UserError(f"--context-overflow {value!r} is not one of "
                            f"{', '.join(o.value for o in cls)}") from None


class ContextFull(UserError):
    """The conversation cannot go on within the context (stop mode, or one message too long)."""


class Template(Protocol):
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Window:
    """The part of a conversation the model sees: non-system messages from `skip` on
    (drop-turns), or the template's tokens from `cut` on after the kept head (shift)."""

    skip: int = 0
    cut: int = 0
    seen: tuple = field(default=(), compare=False)  # the messages last fitted, to tell a continued conversation

    def follow(self, messages: list[dict]) -> "Window":
        """This window if `messages` continue the conversation it was made for, else a fresh one."""
        seen = tuple(_key(m) for m in messages)
        if self.seen and seen[:len(self.seen)] == self.seen:
            return replace(self, seen=seen)
        return Window(seen=seen)


@dataclass(frozen=True)
class Fitted:
    window: Window
    tokens: list[int]  # what the model sees: the kept conversation (and the answer so far)
    note: str | None  # what was dropped, for one dim line


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (the KV a new turn or a draft engine can keep)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fit(tok: Template, messages: list[dict], win: Window, ctx: int, room: int, mode: Overflow,
        answer: list[int] = ()) -> Fitted:
    """The tokens to run: the conversation in `win` plus `answer`, with `room` tokens left for the
    answer. On overflow the window moves (never back) until the tokens fill at most half the context."""
    system, rest = _split(messages)
    answer = list(answer)
    view = lambda w: _view(tok, system, rest, w, mode) + answer  # noqa: E731
    tokens = view(win)
    if len(tokens) + room <= ctx:
        return Fitted(win, tokens, None)
    if mode is Overflow.STOP:
        if len(tokens) < ctx and not answer:
            return Fitted(win, tokens, None)  # it fits; the answer may be cut
        raise ContextFull(f"the conversation needs {len(tokens) + 1} tokens but the context is {ctx}: "
                          f"/clear to start over, raise -c/--ctx-size, or use --context-overflow drop-turns")
    target = max(ctx // 2, 1)
    if mode is Overflow.DROP_TURNS:
        best = None
        for skip in _turn_starts(rest, win.skip):
            best = replace(win, skip=skip), view(replace(win, skip=skip))
            if len(best[1]) <= target:
                break
        if best is None and len(tokens) < ctx and not answer:
            return Fitted(win, tokens, None)  # nothing to drop; it fits, the answer may be cut
        if best is None or len(best[1]) >= ctx:
            n = len(best[1] if best else tokens) - len(answer) + 1
            raise ContextFull(f"the last message needs {n} tokens with the system prompt but the context is "
                              f"{ctx}: raise -c/--ctx-size or shorten the message")
        w, tokens = best
        turns = sum(1 for m in rest[win.skip:w.skip] if m.get("role") == "user")
        return Fitted(w, tokens, f"dropped the {_n(turns, 'oldest turn')} to fit the {ctx}-token context")
    head = _head(tok, system)
    full = tok.apply_chat_template(messages) + answer
    keep = min(head, len(full) - 1)
    tail = target - keep if target - keep >= 1 else ctx - keep - max(room, 1)
    if tail < 1:
        raise ContextFull(f"the system prompt alone fills the {ctx}-token context: raise -c/--ctx-size "
                          f"or shorten the system message")
    cut = max(win.cut, len(full) - keep - tail)
    w = replace(win, cut=cut)
    return Fitted(w, full[:keep] + full[keep + cut:],
                  f"shifted the context: the oldest {cut - win.cut} tokens went, to fit the {ctx}-token context")


def _view(tok: Template, system: list[dict], rest: list[dict], win: Window, mode: Overflow) -> list[int]:
    if mode is Overflow.SHIFT:
        full = tok.apply_chat_template(system + rest)
        keep = min(_head(tok, system), len(full) - 1)
        return full[:keep] + full[keep + win.cut:]
    return tok.apply_chat_template(system + rest[win.skip:])


def _head(tok: Template, system: list[dict]) -> int:
    """Tokens a shift never drops: the system prompt (the template's default one too) and the
    header of the first user message."""
    a = tok.apply_chat_template(system + [{"role": "user", "content": "A"}])
    b = tok.apply_chat_template(system + [{"role": "user", "content": "B"}])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _turn_starts(rest: list[dict], skip: int) -> list[int]:
    """Where the kept conversation may begin: each user message after `skip`, the last one included."""
    return [i for i, m in enumerate(rest) if i > skip and m.get("role") == "user"]


def _split(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return list(messages[:n]), list(messages[n:])


def _key(m: dict) -> tuple:
    return m.get("role"), m.get("content")


def _n(k: int, what: str) -> str:
    return f"{what}" if k == 1 else f"{k} {what}s"
