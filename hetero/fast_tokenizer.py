"""A tokenizer folder (tokenizer.json + tokenizer_config.json) read by the `tokenizers` library and
its chat template rendered by jinja2 the way transformers renders it, without importing
transformers (about a second of `hetero chat`'s start-up). `hetero.tokenizer` falls back to
transformers for every other layout.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


class FastTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.special = {k: _content(v) for k, v in config.items() if k.endswith("_token") and _content(v)}
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else _named(
            config.get("chat_template"))
        eos = self.special.get("eos_token")
        self.eos_token_id = None if eos is None else self.tk.token_to_id(eos)
        self._compiled = None

    def __len__(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tk.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template or "")
        text = self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self.special)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def usable(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _environment():
    """jinja2 as transformers sets it up for chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _named(t: Any) -> str | None:
    if isinstance(t, list):  # named templates: the default one
        return next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t
