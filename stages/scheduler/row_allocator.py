"""Rank rows of the GPU adapter pool: free runs kept sorted by start, best-fit allocation (one run when
any fits, else the fewest runs, largest first) and coalescing on free. Plain CPU code."""

from __future__ import annotations

import bisect

Run = tuple[int, int]  # (first row, rows)


class RowAllocator:
    def __init__(self, total_rows: int):
        if total_rows < 1:
            raise ValueError(f"the adapter pool needs at least one row, got {total_rows}")
        self.total_rows = total_rows
        self._starts = [0]  # free runs, sorted by start, never adjacent (coalesced)
        self._lens = [total_rows]
        self.num_free = total_rows

    @property
    def free_runs(self) -> list[Run]:
        return list(zip(self._starts, self._lens, strict=True))

    def allocate(self, n: int) -> list[Run] | None:
        """`n` rows as runs in the order they hold rank rows; None (nothing taken) when fewer are free."""
        if n < 1:
            raise ValueError(f"an allocation takes at least one row, got {n}")
        if n > self.num_free:
            return None
        fits = [i for i, length in enumerate(self._lens) if length >= n]
        if fits:  # best fit: the smallest run that holds all n, so large runs stay whole
            order = [min(fits, key=lambda i: (self._lens[i], self._starts[i]))]
        else:  # fragmented: the largest runs first, so the load needs the fewest copies
            order = sorted(range(len(self._lens)), key=lambda i: (-self._lens[i], self._starts[i]))
        runs, left = [], n
        for i in order:
            take = min(left, self._lens[i])
            runs.append((self._starts[i], take))
            left -= take
            if left == 0:
                break
        for start, take in runs:
            self._take(start, take)
        return runs

    def _take(self, start: int, n: int) -> None:
        """Remove rows [start, start + n) from the front of the free run starting at `start`."""
        i = bisect.bisect_left(self._starts, start)
        if self._lens[i] == n:
            del self._starts[i], self._lens[i]
        else:
            self._starts[i] += n
            self._lens[i] -= n
        self.num_free -= n

    def free(self, runs: list[Run]) -> None:
        """Give rows back, merging with free neighbours; a row already free or outside the pool raises."""
        for start, n in runs:
            if n < 1 or start < 0 or start + n > self.total_rows:
                raise ValueError(f"run ({start}, {n}) is outside the {self.total_rows}-row pool")
            i = bisect.bisect_left(self._starts, start)
            prev_end = self._starts[i - 1] + self._lens[i - 1] if i else -1
            if prev_end > start or (i < len(self._starts) and self._starts[i] < start + n):
                raise ValueError(f"run ({start}, {n}) is already free in part")
            if prev_end == start:  # grow the previous run
                i -= 1
                self._lens[i] += n
            else:
                self._starts.insert(i, start)
                self._lens.insert(i, n)
            nxt = i + 1
            if nxt < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[nxt]:
                self._lens[i] += self._lens[nxt]
                del self._starts[nxt], self._lens[nxt]
            self.num_free += n
