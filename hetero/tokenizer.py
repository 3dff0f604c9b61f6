"""Tokenizer and chat template, through transformers' AutoTokenizer, offline.

A HF folder supplies tokenizer.json / tokenizer_config.json / chat_template.jinja; a GGUF
file supplies its vocabulary, merges and template in its metadata. Stop tokens are EOS
(from the tokenizer, config and generation_config.json) plus the template's end-of-turn
markers.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hetero import fast_tokenizer
from hetero.errors import UserError
from hetero.paths import cache_dir

log = logging.getLogger(__name__)

# Files one of which a folder's tokenizer is built from (fast, SentencePiece, BPE, tiktoken)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")

# End-of-turn markers of common chat templates; one is a stop token when the template uses it.
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


class Tokenizer:
    def __init__(self, path: Path, is_gguf: bool, eos_ids: tuple[int, ...]):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if not is_gguf and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise UserError(f"{path} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)}): copy them from "
                            f"the model's repository into the folder")
        try:
            if is_gguf:
                self.hf = _gguf_tokenizer(path)
            else:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many types for a folder without tokenizer files
            raise UserError(f"cannot load a tokenizer from {path}: {e}") from e
        self.path = path
        self.stop_ids = self._stop_ids(path, is_gguf, eos_ids)

    def _stop_ids(self, path: Path, is_gguf: bool, eos_ids: tuple[int, ...]) -> frozenset[int]:
        ids = set(eos_ids)
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        gen = path / "generation_config.json"
        if not is_gguf and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        template = self.chat_template or ""
        vocab = self.hf.get_vocab()
        ids.update(vocab[t] for t in _TURN_ENDS if t in template and t in vocab)
        return frozenset(int(i) for i in ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            # No template: plain concatenation, as llama.cpp does for base models.
            text = "".join(m["content"] + "\n" for m in messages)
            return self.encode(text)
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)


def _gguf_tokenizer(path: Path):
    """Converting a GGUF vocabulary takes seconds; keep the converted tokenizer in the cache folder
    and read it back with the `tokenizers` library alone (no transformers import at start-up)."""
    st = path.stat()
    key = f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
    cache = cache_dir() / "tokenizers" / key
    if fast_tokenizer.usable(cache):
        try:
            return fast_tokenizer.FastTokenizer(cache)
        except Exception as e:  # a damaged cache entry: convert again
            log.warning("ignoring the cached tokenizer in %s: %s", cache, e)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        tok.save_pretrained(str(cache))
    except OSError as e:
        log.warning("cannot cache the tokenizer in %s: %s", cache, e)
    return tok


class StreamDecoder:
    """Turns a growing token list into text pieces without splitting multi-byte characters."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece
