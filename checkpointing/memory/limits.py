"""How much memory the memory tier may hold on a worker, and which bound said so.

`checkpoint.memory_limit_gb` when it is set. Otherwise 40% of the smallest of three bounds on
the worker's node, shared among the node's ranks:

- the memory limit of the worker's cgroup (a Kubernetes pod's `resources.limits.memory`,
  Docker's `--memory`, Slurm's `--mem`): cgroup v2 `memory.max`, cgroup v1
  `memory.limit_in_bytes`, the smallest along the cgroup's path up to its root;
- Ray's `memory` resource of the node (`ray start --memory`, else what Ray found free);
- the machine's physical RAM.

A container sees its host's RAM in `SC_PHYS_PAGES`: sized from that alone, a 4 GiB pod on a
256 GiB node would allow itself about 100 GiB and be OOM-killed instead of refused.

The cgroup files are read under a root path, so a test builds a fake tree. Any file that is
missing or unreadable counts as no limit there: discovery never fails a run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
DEFAULT_SHARE = 0.4
"""The share of the bound the tier may hold by default: the rest is the model, the
optimizer, activations, Ray's object store and the task's data."""

# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712 with
# 4 KiB pages; other page sizes round it differently): anything this big is no limit.
V1_UNLIMITED = 1 << 62

@dataclass(frozen=True, kw_only=True)
class MemoryLimit:
    """The tier's limit on one worker, and where it came from."""

    bytes: int
    """Most the tier may hold on this worker."""
    bound: str
    """What set it: configured (checkpoint.memory_limit_gb), cgroup, ray or physical."""
    bound_bytes: int
    """That bound's own bytes, for the whole node (cgroup, ray, physical) or per worker
    (configured)."""

    def describe(self) -> str:
        """What the limit is and where it comes from, for a message."""
        if self.bound == "configured":
            return f"checkpoint.memory_limit_gb allows ({self.bytes / GIB:.2f} GiB)"
        whose = {"cgroup": "the memory limit of the worker's cgroup (its container or job)",
                 "ray": "Ray's memory resource of the node",
                 "physical": "the node's physical memory"}[self.bound]
        return (f"the tier's default allows ({self.bytes / GIB:.2f} GiB: "
                f"{DEFAULT_SHARE:.0%} of {whose}, {self.bound_bytes / GIB:.2f} GiB, shared "
                f"among the node's ranks)")


def memory_limit(limit_gb: float, ranks_on_node: int, *, ray_memory: int | None = None,
                 root: Path = Path("/")) -> MemoryLimit:
    """The tier's limit on a worker: `limit_gb` (checkpoint.memory_limit_gb) if it is set,
    else DEFAULT_SHARE of the smallest bound, shared among `ranks_on_node` ranks."""
    if limit_gb > 0:
        configured = int(limit_gb * GIB)
        return MemoryLimit(bytes=configured, bound="configured", bound_bytes=configured)
    candidates = [("cgroup", cgroup_memory_limit(root)), ("ray", ray_memory),
                  ("physical", physical_memory())]
    # Ties go to the first listed: a cgroup equal to the RAM is still the container's limit.
    bound, total = min(((b, n) for b, n in candidates if n is not None and n > 0),
                       key=lambda c: c[1])
    return MemoryLimit(bytes=int(DEFAULT_SHARE * total / max(1, ranks_on_node)), bound=bound,
                       bound_bytes=total)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The memory limit of this process's cgroup, or None when it has none.

    The cgroup is read from `root`/proc/self/cgroup. cgroup v1's memory controller (a line
    `N:...memory...:/path`) wins over v2 (`0::/path`) when both are listed, as on a hybrid
    host, since the memory controller is then v1's. A limit anywhere from the cgroup up to the
    mount's root applies to it, so the smallest on that path is the limit. Inside a container
    the path may name the host's hierarchy that the container does not see: levels that do
    not exist are skipped, and the mount's own root is read."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif parts[0] == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        return _smallest_on_path(root / "sys/fs/cgroup/memory", v1, "memory.limit_in_bytes")
    if v2 is not None:
        return _smallest_on_path(root / "sys/fs/cgroup", v2, "memory.max")
    return None


def _smallest_on_path(mount: Path, cgroup: str, name: str) -> int | None:
    parts = [p for p in cgroup.split("/") if p and p not in (".", "..")]
    limits = [_read_limit(mount.joinpath(*parts[:depth], name))
              for depth in range(len(parts), -1, -1)]
    known = [n for n in limits if n is not None]
    return min(known) if known else None


def _read_limit(path: Path) -> int | None:
    """A limit file's bytes; None for "max", v1's huge "no limit", or no readable number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max", or something this version does not know
        return None
    value = int(text)
    return value if 0 < value < V1_UNLIMITED else None


_ray_memory: dict[str, int] = {}  # node id -> its memory resource; fixed while the node lives


def ray_node_memory() -> int | None:
    """Ray's `memory` resource of the node this process runs on, or None outside Ray.

    Only a process that has Ray loaded and connected asks (a test of the tier in plain
    processes does not). Read once per node: ray.nodes() asks the GCS about every node."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    node_id = ray.get_runtime_context().get_node_id()
    if node_id not in _ray_memory:
        try:
            nodes = ray.nodes()
        except Exception:  # the GCS unreachable for a moment: the other bounds still hold
            return None
        for node in nodes:
            memory = node.get("Resources", {}).get("memory")
            if node.get("NodeID") == node_id and memory:
                _ray_memory[node_id] = int(memory)
    return _ray_memory.get(node_id)
