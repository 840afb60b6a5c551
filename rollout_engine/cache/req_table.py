"""Request -> token table: row r, column p is the KV slot of token p of the
request holding row r. The numpy table is the scheduler's source of truth.
When a device mirror exists (GPU attention backends build attention indices
from it), the cells written since the last sync are tracked so the mirror
can be brought up to date with one scatter per step."""
from __future__ import annotations

import numpy as np


class ReqToTokenTable:
    def __init__(self, max_rows: int, max_context: int):
        self.max_rows = max_rows
        self.max_context = max_context
        self.table = np.zeros((max_rows, max_context), dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._tracking = False
        self._touched: list[tuple[int, int, int]] = []  # (row, start, length) of each write
        self._touched_cells: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, columns) of each write_cells

    def track_writes(self) -> None:
        """Start recording written cells for `drain_writes` (a table without
        a device mirror records nothing)."""
        self._tracking = True

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows (max_running_requests reached)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        self.table[row, start: start + len(slots)] = slots
        if self._tracking:
            self._touched.append((row, start, len(slots)))

    def write_cells(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """One cell per entry (a decode step: each request's next position)."""
        self.table[rows, cols] = slots
        if self._tracking:
            self._touched_cells.append((rows, cols))

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        return self.table[row, start:end]

    def drain_writes(self) -> np.ndarray | None:
        """The cells written since the last drain as one [3, N] array of
        (row, column, current slot); None if there were none.

        A cell can be written more than once between two drains (a row freed
        and given to a new request, a prefix re-pointed at the cache's copy),
        and a device scatter applies duplicate indices in no defined order.
        So every entry carries the cell's value now, never a past one: the
        duplicates agree and any order of applying them gives the host table."""
        if not (self._touched or self._touched_cells):
            return None
        rows = [np.full(n, r, dtype=np.int64) for r, _, n in self._touched] + [r for r, _ in self._touched_cells]
        cols = [np.arange(c, c + n, dtype=np.int64) for _, c, n in self._touched] + [c for _, c in self._touched_cells]
        self._touched.clear()
        self._touched_cells.clear()
        rows, cols = np.concatenate(rows), np.concatenate(cols)
        return np.stack([rows, cols, self.table[rows, cols]])
