"""Finish conditions for a request after it received a token, and each
request's incremental detokenizer (shared by stop-string detection and the
engine's output builder)."""
from __future__ import annotations

import threading
from typing import Any
from weakref import WeakKeyDictionary

from rollout_engine.detokenizer import IncrementalDetokenizer
from rollout_engine.request import Request


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_context: int, tokenizer: Any = None):
        self.eos = frozenset(eos_token_ids)
        self.max_context = max_context
        self.tokenizer = tokenizer
        # One detokenizer per request, made on first use. Weak keys: an entry
        # goes with its request, however that request ends (stop, length,
        # abort, a stream closed early); the engine also drops it (release())
        # once it built the request's last output.
        self._detoks: WeakKeyDictionary[Request, IncrementalDetokenizer] = WeakKeyDictionary()
        self._lock = threading.Lock()  # the scheduler's thread and output builders share the table

    def check(self, req: Request) -> str | None:
        """Judged on the sampled tokens (placeholders scheduled ahead excluded)."""
        params = req.params
        n = req.num_output_tokens
        token = req.output_ids[n - 1]
        if not params.ignore_eos and token in self.eos:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if params.stop and self._hits_stop_string(req):
            return "stop"
        if n >= params.max_new_tokens or len(req.prompt_ids) + n >= self.max_context:
            return "length"
        return None

    def _hits_stop_string(self, req: Request) -> bool:
        """Fed one token at a time, the detokenizer searches only the text the
        new token added (plus the held tail that may start a stop string), so
        a stop string spanning tokens is found and the cost stays linear."""
        detok = self.detokenizer(req)
        if detok is None or not detok.stopped:
            return False
        req.text = detok.text  # the stop string itself is not part of the text
        return True

    # ---- detokenizers --------------------------------------------------------
    def detokenizer(self, req: Request) -> IncrementalDetokenizer | None:
        """`req`'s detokenizer, fed up to its last sampled token and flushed
        once `req` finished; None without a tokenizer. Requests without stop
        strings are fed here lazily, when their output is built. Call it from
        the thread that steps the scheduler (under the engine's lock) or for a
        finished request."""
        if self.tokenizer is None:
            return None
        with self._lock:
            detok = self._detoks.get(req)
            if detok is None:
                detok = self._detoks[req] = IncrementalDetokenizer(self.tokenizer, req.params.stop or ())
        detok.feed(req.output_ids[detok.num_tokens: req.num_output_tokens])
        if req.finished:
            detok.finish()
        return detok

    def release(self, req: Request) -> None:
        """Forget `req`'s detokenizer (its last output was built)."""
        with self._lock:
            self._detoks.pop(req, None)

    @property
    def num_detokenizers(self) -> int:
        """Detokenizers held (for leak checks)."""
        with self._lock:
            return len(self._detoks)
