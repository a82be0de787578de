"""Process groups and devices: host or join a world's rendezvous, join the world, leave it cleanly.

The device is chosen at run time: CUDA with NCCL when the worker was given a GPU and CUDA
is present, otherwise CPU with gloo. Nothing else in stalwart hard-codes a backend.

The rendezvous is a TCPStore that the world's rank 0 hosts. Rank 0 binds its port before
the address is published and keeps it (`RendezvousHost`): no other process can take the
port in between, and the store listens on the node's address only, not on all interfaces.
The store lives as long as the process group and is released when the world is left, so a
process can join any number of worlds, each at a fresh rendezvous.

Each world is new: a fresh store, fresh groups and, on CUDA, fresh NCCL communicators, made
when the world is joined (`device_id`: eagerly, so a world that cannot form fails there, not
at its first collective). A world that failed is aborted, never destroyed: destroying an NCCL
group flushes its communicators, which waits for collectives a dead peer never joins.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.parallel import nccl

# The store this process's world was formed through (the host's on rank 0, a client's
# elsewhere). The process group holds it too; this reference is the one we can drop.
_world_store: dist.TCPStore | None = None


@dataclass(frozen=True)
class RendezvousAddress:
    """Where a generation of workers meets to form its process group: the address and port
    of the TCPStore that the generation's rank 0 hosts (see RendezvousHost)."""

    host: str
    port: int


class RendezvousHost:
    """The store of one rendezvous, hosted by the process that will be the world's rank 0.

    The listening socket is bound (port 0: the OS picks a free one) and listening before the
    address is known to anyone, and the store serves on that very socket, so the port is
    never free between its choice and its use. Own it until the process joins the world
    (`init_process_group(..., host=this)` hands the store over), or `close()` it.
    """

    def __init__(self, node_ip: str | None, *, timeout_s: float) -> None:
        if node_ip:
            publish = node_ip
            sock = _listener(socket.AF_INET6 if ":" in node_ip else socket.AF_INET, node_ip)
        else:
            # Ray reported no address for this node: listen on all interfaces (as torch's
            # own rendezvous does) and publish the host name for the other ranks to resolve.
            publish = socket.getfqdn()
            sock = _listener(socket.AF_INET, "")
        with sock:
            bound, port = sock.getsockname()[:2]
            # The store's own client connects to the bound address (loopback when it is all
            # interfaces): Ray's address may not lead back to this host from itself.
            here = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound, bound)
            # The store closes the descriptor it serves on when it is destroyed: it gets a
            # duplicate, and ours closes here exactly once, whatever the store does.
            fd = os.dup(sock.fileno())
            try:
                self._store: dist.TCPStore | None = dist.TCPStore(
                    here, port, is_master=True, master_listen_fd=fd,
                    wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            except BaseException:
                _close_if_same_socket(fd, sock)
                raise
        self.address = RendezvousAddress(host=publish, port=port)

    def take_store(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError(f"the rendezvous at {self.address} was closed or already joined")
        store, self._store = self._store, None
        return store

    def close(self) -> None:
        """Stop listening (unless the world joined through it holds the store now)."""
        self._store = None


def free_port() -> int:
    """A port that is free now on this host. Racy (another process may take it before the
    caller binds it): for tests and tools only; a world's rendezvous uses RendezvousHost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _listener(family: socket.AddressFamily, addr: str) -> socket.socket:
    """A socket listening on `addr` at a port the OS picks."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        try:
            sock.bind((addr, 0))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL or not addr:
                raise
            # Ray's address for this node is not one of its interfaces (a NAT in front of
            # it): only all interfaces can be bound. Peers still connect to Ray's address.
            print(f"stalwart: {addr} is not an address of this host; the rendezvous "
                  "listens on all interfaces", file=sys.stderr, flush=True)
            sock.bind(("", 0))
        sock.listen(socket.SOMAXCONN)  # peers that come before the store's thread queue
    except BaseException:
        sock.close()
        raise
    return sock


def _close_if_same_socket(fd: int, sock: socket.socket) -> None:
    """Close `fd`, a duplicate of `sock`, unless a failed store closed it already (then the
    number may name another thread's file by now, which must stay open)."""
    try:
        if os.fstat(fd).st_ino == os.fstat(sock.fileno()).st_ino:
            os.close(fd)
    except OSError:
        pass


def pick_device(want_gpu: bool) -> torch.device:
    if want_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("scaling.gpus_per_worker > 0 but CUDA is not available on this worker")
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so the actor's GPU is always index 0.
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(rdzv: RendezvousAddress, *, rank: int, world_size: int,
                       device: torch.device, timeout_s: float,
                       host: RendezvousHost | None = None) -> None:
    """Join the world that meets at `rdzv`: rank 0 through the store it hosts there (`host`,
    which published `rdzv`), every other rank as a client of that store.

    The store and the process group share `timeout_s` (failure.collective_timeout_s).
    """
    global _world_store
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        if host is None or host.address != rdzv:
            raise ValueError(f"rank 0 must host the rendezvous it joins ({rdzv}); "
                             f"it hosts {host.address if host else 'none'}")
        store = host.take_store()
        store.set_timeout(timeout)
    elif host is not None:
        raise ValueError(f"rank {rank} hosts a rendezvous ({host.address}); only rank 0 may")
    else:
        store = dist.TCPStore(rdzv.host, rdzv.port, is_master=False, timeout=timeout)
    _world_store = store
    backend = backend_for(device)
    if backend == "nccl":
        # Before the process's first NCCL group: torch reads these as groups are created.
        nccl.apply(nccl.nccl_environment(nccl.dump_prefix()))
    try:
        # The prefix is the one torch's own rendezvous gives the default group's keys.
        dist.init_process_group(backend=backend,
                                store=dist.PrefixStore("default_pg", store),
                                rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    except BaseException:
        _world_store = None
        raise


def destroy_process_group() -> None:
    """Leave this process's world. Its groups end (gloo's threads stop, their connections
    close) once nothing references them: DTensor's caches hold the world's meshes, and
    through them its groups, so they are forgotten here; what else held them (a model and
    its optimizer, often in reference cycles) must be gone by then, or collected."""
    global _world_store
    if not dist.is_available():
        return
    forget_dtensor_caches()  # after an abort too (the world is no longer "initialized")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the groups are aborted: what a shutdown could still do is moot
        print(f"stalwart: forgetting the aborted groups failed: {exc}", file=sys.stderr,
              flush=True)
    # On rank 0 the store stops listening once the last group that uses it is gone.
    _world_store = None


def registered_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of in its world: the default group and
    each subgroup (DeviceMesh's, the checkpoint writer's, the memory tier's), newest first.
    torch keeps them in a private registry; without it, the default group alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    names = _group_names()
    if names is None:
        return [dist.distributed_c10d._get_default_group()]
    return sorted(names, key=lambda pg: str(names[pg]), reverse=True)


def _group_names() -> dict[dist.ProcessGroup, str] | None:
    """torch's registry of this process's groups and their names (private: None if gone)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)


# Aborted NCCL groups, kept: after a timeout's dump, a group's heartbeat monitor sleeps
# TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) before it looks whether the group was
# aborted, and ProcessGroupNCCL's destructor joins it. Dropped on the actor's thread, the
# group would hold the survivor's leave that long. Their communicators are aborted (NCCL
# freed them); what stays is a small object per group and failed world.
_aborted_nccl: list[dist.ProcessGroup] = []


def abort_process_groups() -> list[str]:
    """Abort every process group of this process, subgroups included: NCCL's communicators
    are aborted (their kernels exit, any operation on them fails now), so a survivor leaves
    a collective that a dead peer never joins. Returns the names of the groups aborted.

    How a world is left after a failure: a peer lost with its node closes nothing, and a
    peer whose groups are only destroyed keeps their sockets open for as long as anything
    references them; either can leave a survivor blocked in a collective until its timeout.
    gloo's abort wakes nothing (the caller cuts its connections: parallel/world_sockets.py).
    """
    global _world_store
    groups = registered_groups()
    _world_store = None
    if not groups:
        return []
    _aborted_nccl.extend(pg for pg in groups if _has_nccl(pg))
    registry = _group_names() or {}
    names = [str(registry.get(pg, "default")) for pg in groups]
    try:
        # torch's abort of every group, NCCL's inside one ncclGroupStart/End so that
        # communicators sharing a device do not deadlock each other's abort (private API).
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # gone, or one group's abort raised: each on its own
        print(f"stalwart: aborting the world's groups at once failed ({exc}); aborting "
              f"each", file=sys.stderr, flush=True)
        _abort_each(groups)
    return names


def _abort_each(groups: list[dist.ProcessGroup]) -> None:
    """Abort each group, whatever the others do, then forget them (an aborted NCCL
    communicator skips the flush and the destroy that the group's shutdown asks of it)."""
    for pg in groups:
        try:
            pg.abort()
        except Exception as exc:
            print(f"stalwart: aborting a process group failed: {exc}", file=sys.stderr,
                  flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _has_nccl(pg: dist.ProcessGroup) -> bool:
    if not dist.is_nccl_available():
        return False
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend in this group
        return False
    return isinstance(backend, dist.ProcessGroupNCCL)


def shorten_timeouts(timeout_s: float) -> None:
    """A failure is known: whatever this process still waits on in its world (an operation
    already queued excepted: its timeout was fixed when it started) gives up within
    `timeout_s`: the store's requests, each group's next operations, and NCCL's abort, which
    waits for its communicators that long before it raises."""
    timeout = timedelta(seconds=timeout_s)
    if _world_store is not None:
        _world_store.set_timeout(timeout)
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # private API
    for pg in registered_groups() if set_timeout is not None else ():
        try:
            set_timeout(timeout, pg)
        except Exception:
            pass  # a backend without a settable timeout keeps its own


def forget_dtensor_caches() -> None:
    """Drop DTensor's caches of sharding decisions before a process joins a new world.

    DTensor caches the output spec of each op by its input specs, and a DeviceMesh compares
    equal to any mesh of the same shape: a process that was rank 1 of the last world and is
    rank 0 of this one would get the last world's mesh back (its coordinate, its groups)
    for parameters it shards now, and train and checkpoint the wrong shard. The
    sharding-propagation cache is per thread; this clears the calling thread's.

    The redistribute planners are cached by a weak reference to their mesh, but each holds
    its mesh: it never dies, and with it the groups of every world the process was in
    (gloo's threads and connections) and a planner with the last world's coordinate.
    """
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    # The C++ dispatch fast path keeps a cache of its own (per thread).
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # older torch has no planner cache
        clear_planners()
