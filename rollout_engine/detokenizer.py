"""Incremental detokenization: one request's sampled tokens, fed as they
arrive, become text increments that are safe to stream and to search for
stop strings.

Rule (docs/python-api.md, "Outputs"): `output_token_ids` / `output_logprobs` keep every sampled
token, the tokens that formed a stop string included (a trainer trains on
what was sampled); the text ends right before the first stop string. The
concatenation of all increments of a request is its text, so a stream's
delta texts add up to what `generate` returns for the same tokens.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


class IncrementalDetokenizer:
    """Turns one request's token ids, fed in order, into text increments that

    - hold complete characters only: byte-level BPE tokenizers (and
      SentencePiece byte fallback) split a multi-byte character over several
      tokens, and decoding part of it gives U+FFFD. Each feed decodes a short
      window (the tokens of the previous increment, as context for
      tokenizers whose decoding of a token depends on its neighbours, plus
      the new ones) and releases what the new tokens added; while that ends
      in U+FFFD, the new tokens are held back until a later one completes
      the character.
    - never contain a stop string nor a tail that may still become one: the
      longest tail of the text that is a prefix of some stop string is
      withheld until later text decides. When a stop string shows up, the
      text before it is released, it and everything after are dropped and
      `stopped` is set; later tokens are counted but add no text.

    `finish()` flushes what is still held (an incomplete character comes out
    as U+FFFD, as `tokenizer.decode` gives it; a held stop-string prefix that
    did not become one is released). Then the concatenation of all increments
    equals `tokenizer.decode(all ids, skip_special_tokens=...)` cut right
    before its first stop string.

    Increments are returned by `feed` / `finish` and also kept, so that a
    reader that does not feed (the engine's output builder, while the
    scheduler feeds) gets them with `read()`. Cost: two decodes of a few
    tokens per feed, O(total length) over a request (a window grows only
    while its text keeps ending in U+FFFD). Not thread-safe: one feeder at a
    time.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        # Every proper prefix of a stop string: the candidates for a held tail.
        self._stop_prefixes = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self.num_tokens = 0  # ids fed so far
        self.stopped = False  # a stop string was found; the text ends before it
        self.finished = False
        # Decoding window: _ids[:_num_context] are the tokens of the last
        # increment (context, text `_context_text`), the rest are not released yet.
        self._ids: list[int] = []
        self._num_context = 0
        self._context_text = ""
        self._held = ""  # decoded, but possibly the start of a stop string
        self._parts: list[str] = []  # every released increment
        self._num_read = 0  # parts already returned by read()

    # ---- feeding -------------------------------------------------------------
    def feed(self, token_ids: Sequence[int]) -> str:
        """Add the next sampled ids; returns the text they release (maybe "")."""
        if len(token_ids) == 0:
            return ""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.num_tokens += len(token_ids)
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._context_text):
            return ""  # an incomplete character (or only skipped special tokens) so far
        new = text[len(self._context_text):]
        self._ids = self._ids[self._num_context:]  # the new tokens are the next context
        self._num_context = len(self._ids)
        self._context_text = self._decode(self._ids)
        return self._release(new)

    def finish(self) -> str:
        """The request ended: release what is held back (an incomplete
        character as U+FFFD; a tail that did not become a stop string).
        Idempotent; returns the last increment."""
        if self.finished:
            return ""
        self.finished = True
        out = ""
        if not self.stopped:
            text = self._decode(self._ids) if len(self._ids) > self._num_context else ""
            if len(text) > len(self._context_text):
                out = self._release(text[len(self._context_text):])
            if not self.stopped and self._held:
                out += self._emit(self._held)
                self._held = ""
        self._ids, self._context_text = [], ""
        return out

    # ---- reading -------------------------------------------------------------
    def read(self, from_start: bool = False) -> str:
        """Released text not returned by read() before (all of it with
        `from_start`); marks it read."""
        start = 0 if from_start else self._num_read
        if len(self._parts) - start > 1:
            joined = "".join(self._parts[start:])
            self._parts[start:] = [joined]
        self._num_read = len(self._parts)
        return self._parts[start] if start < len(self._parts) else ""

    @property
    def text(self) -> str:
        """All text released so far (the whole text once finished)."""
        return "".join(self._parts)

    # ---- internals -----------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, new: str) -> str:
        """Pass newly decoded text through the stop-string filter."""
        if not self.stop:
            return self._emit(new)
        # A stop string ending in `new` starts within the held tail: the part
        # before `new` is a suffix of the text and a prefix of that stop
        # string, so no longer than the held tail (the longest such suffix).
        buf = self._held + new
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            self._ids, self._context_text = [], ""
            return self._emit(buf[: min(hits)])
        keep = 0
        for k in range(min(self._max_held, len(buf)), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                keep = k
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._emit(buf[: len(buf) - keep])

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
