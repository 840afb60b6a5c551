"""Finish conditions for a request after it received a token."""
from __future__ import annotations

from typing import Any

from rollout_engine.request import Request


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_context: int, tokenizer: Any = None):
        self.eos = frozenset(eos_token_ids)
        self.max_context = max_context
        self.tokenizer = tokenizer

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
        text = self.tokenizer.decode(req.output_ids[: req.num_output_tokens], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        if not hits:
            return False
        req.text = text[: min(hits)]  # the stop string itself is not part of the text
        return True
