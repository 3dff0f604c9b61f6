"""The OpenAI wire format: request bodies (validated by pydantic), replies, chunks, errors.

Field names and shapes follow OpenAI's API as vLLM and llama-server accept it; `top_k`,
`min_p`, `repetition_penalty` and `ignore_eos` are the usual extensions those servers take.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields other clients send (user, logit_bias…) are accepted


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # -1 or 0: off
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    ignore_eos: bool = False

    def params(self) -> dict:
        """Sampling overrides for `Engine.sequence` (None: the server's default)."""
        return dict(temperature=self.temperature, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                    top_k=None if self.top_k is None else max(0, self.top_k),
                    repeat_penalty=self.repetition_penalty)

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int]]


# ---------------------------------------------------------------------- replies
def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_reply(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use}


def completion_reply(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


class StopFilter:
    """Cuts the text at the first stop string; while streaming, holds back what could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def push(self, text: str) -> str:
        """Text now safe to send; sets `hit` when a stop string appeared (the rest is dropped)."""
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        n = len(self.buf) - self.hold
        out, self.buf = (self.buf[:n], self.buf[n:]) if n > 0 else ("", self.buf)
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
