"""pytest-xdist's `--dist loadfile`, made safe for a worker that dies mid-run.

The suite runs a module's tests on one worker, so the module's Ray instance is shared. When a
worker process dies (a test's fault reached it, or the kernel's OOM killer), xdist 3.8's
file scheduler hands its whole workload back, finished files too. A finished file goes out
again as an empty batch that never completes, and once those are all that is left, every
worker waits for work that never comes: the session hangs until CI's limit. This scheduler
requeues only the files with tests still to run, never reruns the test that took the worker
down (it is reported failed), and never leaves a worker holding a single test with nothing
after it (a worker runs its last test only once it is sent the next or told to stop).
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController


class CrashSafeLoadFileScheduling(LoadFileScheduling):
    def remove_node(self, node: WorkerController) -> str | None:
        workload = self.assigned_work.get(node, {})
        crashed = next((nodeid for unit in workload.values()
                        for nodeid, done in unit.items() if not done), None)
        if crashed is not None:  # reported failed by the session; a rerun would crash again
            workload[self._split_scope(crashed)][crashed] = True
        for scope in [s for s, unit in workload.items() if all(unit.values())]:
            del workload[scope]
        super().remove_node(node)
        return crashed

    def _reschedule(self, node: WorkerController) -> None:
        super()._reschedule(node)
        if node.shutting_down or node not in self.assigned_work:
            return
        if self._pending_of(self.assigned_work[node]) == 1:
            if self.workqueue:
                self._assign_work_unit(node)
            else:
                node.shutdown()
