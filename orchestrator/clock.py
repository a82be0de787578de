"""The controller's clock: the time (time.time) and its pauses. A real one by default; tests
pass a fake one that moves only when told to, so every duration they check is exact."""

from __future__ import annotations

import time


class Clock:
    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
