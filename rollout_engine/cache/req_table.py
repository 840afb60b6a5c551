"""Request -> token table: row r, column p is the KV slot of token p of the
request holding row r. CPU data owned by the scheduler."""
from __future__ import annotations

import numpy as np


class ReqToTokenTable:
    def __init__(self, max_rows: int, max_context: int):
        self.max_context = max_context
        self.table = np.zeros((max_rows, max_context), dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows (max_running_requests reached)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        self.table[row, start: start + len(slots)] = slots

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        return self.table[row, start:end]
