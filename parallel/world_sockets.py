"""The TCP connections a worker opened for its world, to cut when it leaves a failed world.

A peer that froze, powered off or was cut off closes nothing, and gloo cannot abort a
collective (ProcessGroupGloo.abort() leaves it waiting): a survivor in a collective with that
peer waits for `failure.collective_timeout_s`, and so does every survivor waiting on that one.
Shutting down its own connections makes the collective fail at once, here and on each peer
waiting on this process. NCCL's abort does this itself; the cut is harmless there.

The world's connections are those that appeared while it was set up (process groups, device
meshes, the rendezvous store), read from /proc. Linux only: elsewhere nothing is cut, and a
survivor that cannot leave its world is replaced.
"""

from __future__ import annotations

import os
import socket

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"  # the state column of a listening socket


def _socket_fds() -> dict[int, int]:
    """inode -> fd of every socket this process holds."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def _tcp_connection_inodes() -> set[int]:
    """Inodes of the TCP connections in this network namespace. Listening sockets are left
    out: gloo's listener aborts the process when its socket is shut down under it."""
    out = set()
    for table in TCP_TABLES:
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        out.update(int(row[9]) for row in rows if row[3] != LISTEN)
    return out


def tcp_connections() -> set[int]:
    """Inodes of the TCP connections (not listening sockets) this process holds now."""
    return _socket_fds().keys() & _tcp_connection_inodes()


def cut(inodes: set[int]) -> int:
    """Shut down those of these sockets this process still holds; returns how many."""
    done = 0
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        try:
            # A duplicate of the fd: shutdown() acts on the connection, which its owner (gloo)
            # then sees fail; the owner keeps its fd, and closes it when it is done.
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue
    return done
