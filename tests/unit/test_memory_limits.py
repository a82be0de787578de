"""The memory tier's default limit comes from the container, Ray and the machine, whichever
is smallest (checkpointing/memory/limits.py), read from fake cgroup file trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpointing.memory import limits
from stalwart.checkpointing.memory.limits import (
    GIB,
    MemoryLimit,
    cgroup_memory_limit,
    memory_limit,
    physical_memory,
    ray_node_memory,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

V1_NO_LIMIT = "9223372036854771712\n"  # what a v1 kernel with 4 KiB pages writes

V2_PROC = "0::/kubepods.slice/pod1/cri-abc\n"
V1_PROC = ("12:memory:/kubepods/pod1/abc\n11:cpu,cpuacct:/kubepods/pod1/abc\n"
           "1:name=systemd:/kubepods/pod1/abc\n0::/\n")


def tree(root: Path, proc: str | None, files: dict[str, str]) -> Path:
    """A fake / : proc/self/cgroup holding `proc`, and each file under sys/fs/cgroup."""
    if proc is not None:
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(proc)
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_memory_max(tmp_path: Path) -> None:
    root = tree(tmp_path, V2_PROC, {"kubepods.slice/pod1/cri-abc/memory.max": "4294967296\n"})
    assert cgroup_memory_limit(root) == 4 * GIB


def test_cgroup_v2_max_is_no_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, V2_PROC, {"kubepods.slice/pod1/cri-abc/memory.max": "max\n",
                                    "memory.max": "max\n"})
    assert cgroup_memory_limit(root) is None


def test_a_limit_on_a_parent_cgroup_bounds_a_nested_one(tmp_path: Path) -> None:
    # Slurm puts the limit on the job; the process lives in a step's task cgroup under it.
    proc = "0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n"
    base = "system.slice/slurmstepd.scope/job_42"
    root = tree(tmp_path, proc, {f"{base}/memory.max": str(8 * GIB),
                                 f"{base}/step_0/memory.max": "max",
                                 f"{base}/step_0/user/task_0/memory.max": str(16 * GIB)})
    assert cgroup_memory_limit(root) == 8 * GIB


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path: Path) -> None:
    # Without a cgroup namespace the path names the host's hierarchy, which the container's
    # /sys/fs/cgroup does not hold: its own limit is at the mount's root.
    root = tree(tmp_path, "0::/docker/0123abcd\n", {"memory.max": str(2 * GIB)})
    assert cgroup_memory_limit(root) == 2 * GIB


def test_cgroup_v1_limit_in_bytes(tmp_path: Path) -> None:
    root = tree(tmp_path, V1_PROC, {
        "memory/kubepods/pod1/abc/memory.limit_in_bytes": str(3 * GIB),
        "memory/kubepods/memory.limit_in_bytes": V1_NO_LIMIT,
        "memory/memory.limit_in_bytes": V1_NO_LIMIT,
        "memory.max": "1024\n"})  # a v2 file the hybrid host's memory controller ignores
    assert cgroup_memory_limit(root) == 3 * GIB


def test_cgroup_v1_sentinel_is_no_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, V1_PROC, {
        "memory/kubepods/pod1/abc/memory.limit_in_bytes": V1_NO_LIMIT,
        "memory/memory.limit_in_bytes": "9223372036854775807\n"})  # 64 KiB pages: unaligned
    assert cgroup_memory_limit(root) is None


@pytest.mark.parametrize("proc, files", [
    (None, {}),  # no /proc/self/cgroup (not Linux, or /proc not mounted)
    ("0::/\n", {}),  # v2 with no memory.max at the root (the host itself)
    ("garbage\n\n", {"memory.max": "1024"}),
    ("0::/a\n", {"a/memory.max": "lots\n"}),  # a value this version does not know
], ids=["no-proc", "v2-host-root", "unparsable-proc", "unparsable-limit"])
def test_no_cgroup_limit(tmp_path: Path, proc: str | None, files: dict[str, str]) -> None:
    assert cgroup_memory_limit(tree(tmp_path, proc, files)) is None


def test_the_smallest_bound_applies(tmp_path: Path) -> None:
    cgroup = tree(tmp_path / "pod", V2_PROC,
                  {"kubepods.slice/pod1/cri-abc/memory.max": str(4 * GIB)})
    none = tree(tmp_path / "bare", None, {})
    ram = physical_memory()

    # A 4 GiB pod on a bigger node: the pod's limit, shared by its 2 ranks.
    assert memory_limit(0.0, 2, ray_memory=ram, root=cgroup) == MemoryLimit(
        bytes=int(0.4 * 4 * GIB / 2), bound="cgroup", bound_bytes=4 * GIB)
    # Ray told to use less than the pod has (ray start --memory).
    assert memory_limit(0.0, 1, ray_memory=GIB, root=cgroup) == MemoryLimit(
        bytes=int(0.4 * GIB), bound="ray", bound_bytes=GIB)
    # Neither a container nor Ray: the machine's RAM, as before.
    assert memory_limit(0.0, 4, root=none) == MemoryLimit(
        bytes=int(0.4 * ram / 4), bound="physical", bound_bytes=ram)
    # A cgroup "limit" above the RAM (a v1 limit short of the sentinel): the RAM.
    big = tree(tmp_path / "big", "0::/\n", {"memory.max": str(ram * 2)})
    assert memory_limit(0.0, 1, root=big).bound == "physical"


def test_a_configured_limit_wins_over_every_bound(tmp_path: Path) -> None:
    cgroup = tree(tmp_path, V2_PROC, {"kubepods.slice/pod1/cri-abc/memory.max": str(GIB)})
    limit = memory_limit(2.5, 8, ray_memory=GIB, root=cgroup)
    assert limit == MemoryLimit(bytes=int(2.5 * GIB), bound="configured",
                                bound_bytes=int(2.5 * GIB))
    assert limit.describe() == "checkpoint.memory_limit_gb allows (2.50 GiB)"


def test_the_refusal_names_the_bound(tmp_path: Path) -> None:
    cgroup = tree(tmp_path, V2_PROC, {"kubepods.slice/pod1/cri-abc/memory.max": str(4 * GIB)})
    text = memory_limit(0.0, 2, root=cgroup).describe()
    assert text == ("the tier's default allows (0.80 GiB: 40% of the memory limit of the "
                    "worker's cgroup (its container or job), 4.00 GiB, shared among the "
                    "node's ranks)")


def test_outside_ray_there_is_no_ray_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process that never loaded Ray (a plain torch.distributed test of the tier) asks nobody.
    import sys

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(limits, "_ray_memory", {})
    assert ray_node_memory() is None


def test_the_memory_tier_event_names_the_tightest_workers_bound(tmp_path: Path) -> None:
    """The controller's TierReporter, fed the ranks' statuses: `memory_tier` carries the
    smallest limit any worker has, and the bound that set it."""
    from stalwart.core.config import load_config
    from stalwart.core.events import MemoryTier, read_events
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.reporting import TIER_STEADY_AFTER, TierReporter
    from stalwart.orchestrator.states import Running
    from stalwart.workers.reports import WorkerStatus

    events = EventLog(tmp_path / "events.jsonl")
    reporter = TierReporter(load_config(None), events)
    reporter.after_launch(0, world_size=2, now=0.0)
    roomy = MemoryLimit(bytes=4 * GIB, bound="ray", bound_bytes=20 * GIB)
    tight = MemoryLimit(bytes=GIB, bound="cgroup", bound_bytes=5 * GIB)
    for rank, limit in enumerate([roomy, tight]):
        reporter.on_status(rank, WorkerStatus(rank=rank, generation=0, steps=[], commits=[],
                                              done=False, snapshot_bytes=1000 + rank,
                                              tier_limit=limit), now=1.0)
    reporter.after_poll(Running(generation=0, start_step=0), TIER_STEADY_AFTER, now=2.0)

    (event,) = [e for e in read_events(events.path) if isinstance(e, MemoryTier)]
    assert (event.bytes_per_worker, event.bytes_total) == (1001, 2001)
    assert (event.limit_bytes, event.limit_bound, event.limit_bound_bytes) == \
        (GIB, "cgroup", 5 * GIB)
