"""Restoring from storage for the controller: the newest checkpoint that verifies, the older
ones to fall back on when it fails to load, and why a fresh start would throw committed work
away.

It reads storage and writes the log; it never acts on the group and never decides the
controller's state. The controller loads each candidate on the group (`candidates`, `skip`)
and turns the reason `lost` gives into a failed run.

Every damaged checkpoint passed over is written as `checkpoint_skipped`, and one accepted
unsigned (--trust-unsigned) as `unsigned_checkpoint_accepted`, so the log says why a run
restored the step it did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import CheckpointInfo, list_step_dirs, newest_valid
from stalwart.core import events as ev
from stalwart.orchestrator.restore import nothing_restorable

if TYPE_CHECKING:
    from stalwart.checkpointing.storage.signing import CheckpointTrust
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.observers import Display
    from stalwart.orchestrator.reporting import CommitLog


class StorageRestore:
    def __init__(self, storage_url: str, trust: CheckpointTrust, *, events: EventLog,
                 display: Display, commits: CommitLog) -> None:
        self.storage_url = storage_url
        self.trust = trust  # what a restore from storage accepts (--trust-unsigned, keys)
        self.events, self.display, self.commits = events, display, commits
        self.skipped: list[tuple[int, str]] = []  # checkpoints skipped in this restore

    def start(self) -> None:
        """A new world's restore: nothing skipped yet."""
        self.skipped = []

    def newest_step(self) -> int:
        """The newest valid step (0: none), where a resume would start; nothing logged."""
        newest = newest_valid(self.storage_url, self.trust)
        return newest.step if newest else 0

    def newest_valid(self, below: int | None = None) -> CheckpointInfo | None:
        """The newest checkpoint that verifies (below step `below`)."""
        # The ranks check every file's sha256 as they read it (a change after this check is
        # caught too); here only the signature, the listing and the sizes.
        found = newest_valid(self.storage_url, self.trust, below=below,
                             on_skip=self._on_damaged, hashes=False)
        if found is not None and found.unsigned:
            self.events.emit(ev.UnsignedCheckpointAccepted(step=found.step, path=found.path,
                                                           why=found.unsigned))
        return found

    def candidates(self, checkpoint: CheckpointInfo) -> Iterator[CheckpointInfo]:
        """`checkpoint`, then, each time the one before failed to load (`skip`), the next
        older one that verifies, until there is none."""
        while True:
            yield checkpoint
            older = self.newest_valid(below=checkpoint.step)
            if older is None:
                return
            checkpoint = older
            self.display.log(f"restoring from storage's step {older.step} instead")

    def skip(self, checkpoint: CheckpointInfo, why: str) -> None:
        """`checkpoint` failed to load on the ranks: it is passed over, and logged."""
        self._on_damaged(checkpoint.step, why)

    def lost(self, memory_why: str | None) -> str | None:
        """Why the world must not start from step 0 when checkpoints were committed but none
        can be restored (a fresh start would silently throw their work away); None when
        nothing was ever committed."""
        committed = [s for s, done in list_step_dirs(self.storage_url) if done]
        reason = nothing_restorable(committed=committed, newest_reported=self.commits.newest,
                                    skipped=self.skipped, memory_why=memory_why)
        if reason is not None:
            self.display.log(reason)
        return reason

    def log_unreported_commit(self) -> None:
        """A failed run's last commit that rank 0 wrote but did not live to report (it died
        before the next poll): logged, so the log names what a resume will start from.
        Called once the workers are gone, when no commit can still be landing."""
        try:
            self.commits.found(newest_valid(self.storage_url, self.trust))
        except (OSError, CheckpointError) as exc:  # the failure may be storage itself
            self.display.log(f"could not list the checkpoints after the failure: {exc}")

    def _on_damaged(self, step: int, message: str) -> None:
        self.skipped.append((step, message))
        self.events.emit(ev.CheckpointSkipped(step=step, message=message))
        self.display.log(f"skipping damaged checkpoint: {message}")
