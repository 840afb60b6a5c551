"""Tokenizer loading and the chat-template helper."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str) -> bool:
    return os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def load_tokenizer(model: str, tokenizer: str | None) -> Any:
    """The tokenizer at `tokenizer`, else the model folder's, else None."""
    path = tokenizer if tokenizer is not None else model
    if tokenizer is not None and not has_tokenizer_files(tokenizer):
        raise ValueError(f"tokenizer {tokenizer!r} is not a folder with tokenizer files")
    if not has_tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except ImportError:  # a package this tokenizer needs (sentencepiece, ...): transformers names it
        raise
    except Exception as e:  # noqa: BLE001 - damaged files: a decode error, broken JSON, a backend refusal
        said = " ".join(str(e).split()) or type(e).__name__
        raise OSError(f"{path}: its tokenizer files cannot be read ({type(e).__name__}: {said[:300]})") from None


# Tokens a tokenizer may have past the model's vocabulary and still be the
# model's own: a few added after training without resizing the embeddings
# (a pad token, say), which only requests that use them are refused for.
EXTRA_TOKENS_OK = 256


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, given: str | None) -> None:
    """A tokenizer with many more tokens than the model's vocabulary belongs
    to another model: refused. A few more: a warning (requests with those ids
    are refused one by one). Fewer is common: embeddings padded past the
    tokens."""
    if tokenizer is None:
        return
    n = len(tokenizer)
    if n <= vocab_size:
        return
    where = f"tokenizer {given!r}" if given is not None else "the model folder's tokenizer"
    if n - vocab_size > max(EXTRA_TOKENS_OK, vocab_size // 100):
        raise ValueError(f"{where} has {n} tokens, more than the model's vocabulary of {vocab_size}: it belongs to "
                         "another model")
    log.warning("%s has %d tokens, %d more than the model's vocabulary of %d (added without resizing the "
                "embeddings?): requests with those ids are refused", where, n, n - vocab_size, vocab_size)


def check_messages(messages: Any) -> None:
    """A chat: a list of {'role': ..., 'content': ...} dicts; else a
    ValueError naming what is wrong, before the template sees it."""
    if isinstance(messages, str):
        raise ValueError("messages: a list of {'role': ..., 'content': ...} dicts, got a string; for one user "
                         "turn pass [{'role': 'user', 'content': text}]")
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages: a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: empty; a chat needs at least one turn")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"messages[{i}]: a dict with a 'role' string and a 'content', got {str(m)[:80]}")
        if not isinstance(m["content"], (str, list)) and m["content"] is not None:
            raise ValueError(f"messages[{i}]: content must be a string (or a list of parts), got "
                             f"{type(m['content']).__name__}")


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    if tokenizer is None:
        raise ValueError("a chat template needs a tokenizer; pass tokenizer=... to the engine")
    check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template's own refusals (jinja's errors: roles out of order, ...)
        if not (type(e).__module__.startswith("jinja2") or isinstance(e, TypeError)):  # TypeError: content it
            raise                                                                     # cannot join (parts, None)
        raise ValueError(f"messages: the model's chat template refuses them ({' '.join(str(e).split())})") from None
    return tokenizer.encode(text, add_special_tokens=False)


def tokenizer_eos_ids(tokenizer) -> tuple[int, ...]:
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (tokenizer.eos_token_id,)
