"""Request -> token table: row r, column p is the KV slot of token p of the
request holding row r. The numpy table is the scheduler's source of truth;
writes are also logged so the runner can mirror them into a device copy with
one scatter per step (GPU kernels build attention indices from it)."""
from __future__ import annotations

import numpy as np


class ReqToTokenTable:
    def __init__(self, max_rows: int, max_context: int):
        self.max_rows = max_rows
        self.max_context = max_context
        self.table = np.zeros((max_rows, max_context), dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._log: list[tuple[int, int, np.ndarray]] = []

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows (max_running_requests reached)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        self.table[row, start: start + len(slots)] = slots
        self._log.append((row, start, np.asarray(slots, dtype=np.int64)))

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        return self.table[row, start:end]

    def drain_writes(self) -> np.ndarray | None:
        """Every write since the last drain as one [3, N] array of (row,
        column, slot), in order (later writes win); None if there were none."""
        if not self._log:
            return None
        rows = np.concatenate([np.full(len(s), r, dtype=np.int64) for r, _, s in self._log])
        cols = np.concatenate([np.arange(c, c + len(s), dtype=np.int64) for _, c, s in self._log])
        vals = np.concatenate([s for _, _, s in self._log])
        self._log.clear()
        return np.stack([rows, cols, vals])
