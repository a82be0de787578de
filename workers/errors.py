"""Whose fault an exception in the training thread is: the task's code, or the world's.

A collective fails on a healthy rank when a peer dies, hangs or leaves (gloo: "Connection
closed by peer", a timeout; NCCL: a watchdog abort): that rank did nothing wrong and is
recovered in place. Anything else came from the task's code (or a bug of ours) and would
fail the same way again, so by default it is not retried.
"""

from __future__ import annotations

import torch.distributed as dist

from stalwart.checkpointing.errors import CheckpointError
from stalwart.workers.numerics import NumericsEscalation

# What torch's process groups put in the messages of a failed or timed-out collective.
COLLECTIVE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "gloo/transport", "Timed out waiting", "ProcessGroupNCCL", "NCCL error", "Socket Timeout",
)


class RestoredStepMismatch(CheckpointError):
    """The ranks of a new world restored different steps (checked before training goes on)."""


def classify_exception(exc: BaseException) -> str:
    """"collective" for a failed collective (retryable), "numerics" for a numerical fault the
    world could not mend, "user" for everything else."""
    if isinstance(exc, NumericsEscalation):
        return "numerics"
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # a collective error may be wrapped (DCP)
        seen.add(id(e))
        if isinstance(e, dist.DistError):
            return "collective"
        if any(marker in str(e) for marker in COLLECTIVE_MARKERS):
            return "collective"
        e = e.__cause__ or e.__context__
    return "user"
