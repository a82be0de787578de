"""The rendezvous store: bound by the process that hosts it, on the address it is given, and
held from the moment its address is known until it is closed (no port race, no listening on
all interfaces, no socket left behind)."""

from __future__ import annotations

import errno
import os
import signal
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from stalwart.core.config import load_config
from stalwart.parallel.distributed import RendezvousHost
from stalwart.workers.actor import TrainWorker
from tests.cli_helpers import REFERENCE_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _address(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host byte order)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listeners(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that process `pid` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addr, port = local.split(":")
                found.add((_address(addr), int(port, 16)))
    return found


def listening_on(*ports: int, pid: int | str = "self") -> set[tuple[str, int]]:
    """The listeners of process `pid` on these ports (other tests may leave listeners of
    their own in this process)."""
    return {lst for lst in listeners(pid) if lst[1] in ports}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def bind_fails(family: socket.AddressFamily, addr: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as other:
        try:
            other.bind((addr, port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return True
        return False


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_store_listens_on_the_given_address_and_holds_its_port():
    host = RendezvousHost("127.0.0.1", timeout_s=30)
    try:
        port = host.address.port
        assert host.address.host == "127.0.0.1" and port > 0
        # One listener for the store, on that address: not 0.0.0.0.
        assert listening_on(port) == {("127.0.0.1", port)}
        # The port is taken from the moment the address is known: nobody can bind it now.
        assert bind_fails(socket.AF_INET, "127.0.0.1", port)
        assert bind_fails(socket.AF_INET, "0.0.0.0", port)
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=30))
        client.set("hello", "world")
        assert host.take_store().get("hello") == b"world"
        del client
    finally:
        host.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_node_address_hosts_on_ipv6():
    host = RendezvousHost("::1", timeout_s=30)
    try:
        port = host.address.port
        assert listening_on(port) == {("::1", port)}
        assert bind_fails(socket.AF_INET6, "::1", port)
        client = dist.TCPStore("::1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert host.take_store().get("k") == b"v"
        del client
    finally:
        host.close()


def test_without_a_usable_node_address_the_store_listens_on_all_interfaces(capfd):
    # No address from Ray: the host name is published.
    host = RendezvousHost(None, timeout_s=30)
    try:
        assert host.address.host == socket.getfqdn()
        assert listening_on(host.address.port) == {("0.0.0.0", host.address.port)}
    finally:
        host.close()
    # An address that is not this host's (TEST-NET-3; Ray behind a NAT): it is still what
    # the peers are told, and the worker's log says why the store listens everywhere.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("203.0.113.7", 0))
            pytest.skip("203.0.113.7 is an address of this host")
        except OSError:
            pass
    host = RendezvousHost("203.0.113.7", timeout_s=30)
    try:
        assert host.address.host == "203.0.113.7"
        assert listening_on(host.address.port) == {("0.0.0.0", host.address.port)}
    finally:
        host.close()
    assert "203.0.113.7 is not an address of this host" in capfd.readouterr().err


def test_closing_frees_the_port_and_leaves_no_descriptor():
    RendezvousHost("127.0.0.1", timeout_s=30).close()  # torch's lazy set-up, once
    before = open_fds()
    ports = []
    for _ in range(5):
        host = RendezvousHost("127.0.0.1", timeout_s=30)
        ports.append(host.address.port)
        host.close()
        assert not bind_fails(socket.AF_INET, "127.0.0.1", ports[-1])
    assert open_fds() == before
    assert listening_on(*ports) == set()


def test_a_worker_asked_twice_hosts_only_the_last_rendezvous(tmp_path):
    """A world that fails while it forms is formed again: its rank 0 is asked for a new
    rendezvous, and the first one must not stay open (nor after the worker leaves)."""
    config = load_config(REFERENCE_CONFIG, [])
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker installs its own handler
    try:
        worker = TrainWorker(config.to_dict(), str(tmp_path / "storage"))
        first = worker.rendezvous_address()
        assert listening_on(first.port) == {(first.host, first.port)}
        second = worker.rendezvous_address()
        assert second.port != first.port
        assert listening_on(first.port, second.port) == {(second.host, second.port)}
        assert not bind_fails(socket.AF_INET6 if ":" in first.host else socket.AF_INET,
                              first.host, first.port)
        assert worker.leave(1.0).left
        assert listening_on(first.port, second.port) == set()
    finally:
        signal.signal(signal.SIGTERM, sigterm)
