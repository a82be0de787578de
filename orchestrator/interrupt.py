"""Ctrl-C on the driver: the first stops the run after the step in flight and checkpoints it;
the second abandons it (KeyboardInterrupt).

A flag rather than KeyboardInterrupt at the first, so the interrupt never lands half-way
through the controller's own bookkeeping. Only the main thread may own signal handlers:
elsewhere (a Tune trial's thread) nothing is installed and the flag stays as it is set.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def uninstall(self) -> None:
        """Put the handler that was there back."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
