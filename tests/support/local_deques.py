"""An in-process `claim` (balance.plan.ClaimFn) for tests that run ranks as threads."""
import threading


class LocalDeques:
    """In-process `claim` (ClaimFn) for threads and tests: one deque per (version, owner)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ends: dict[tuple[int, int], list[int]] = {}

    def claim(self, version: int, owner: int, count: int, steal: bool) -> int:
        with self._lock:
            ends = self._ends.setdefault((version, owner), [0, count])
            if ends[0] >= ends[1]:
                return -1
            if steal:
                ends[1] -= 1
                return ends[1]
            ends[0] += 1
            return ends[0] - 1
