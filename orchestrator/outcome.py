"""What a run came to, as the controller hands it to its caller: a frozen summary.

The trainer reads this once the controller's loop has ended (or was interrupted), instead of
the controller's own accounts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Outcome:
    step: int
    """The last step the run completed (the resumed step, if it trained none)."""
    loss: float | None
    """That step's loss (None: no step was trained)."""
    val_loss: float | None
    """The last validation loss reported."""
    stop_signal: int | None
    """The signal that stopped the run (SIGINT, SIGTERM) when it ended STOPPED by one."""
    tokens_per_s: float | None
    """All tokens trained over the time the workers spent in steps (None: none trained)."""
