"""Joining a Ray cluster, or starting Ray on this machine: one way for every command that
needs Ray on the driver (`stalwart run`, `stalwart sweep`)."""

from __future__ import annotations

import logging
import os
import socket

from stalwart.core.errors import ClusterError
from stalwart.core.ray_private import AUTH_NOTICE_LOGGER

# Ray settings for the Ray that stalwart starts on this machine (a cluster keeps its own):
# Ray runs workers at nice 15 by default, so its daemons preempt them; a rank delayed that
# way stalls every rank at the next collective. With no dashboard, metrics go nowhere. And
# Ray would start a worker per CPU for the first driver: none of them hosts a rank (each
# actor gets a process of its own), so they only take CPU from the ranks' start (a 6-step
# run on 2 cores took 4 s longer with them).
EMBEDDED_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "enable_metrics_collection": False,
                              "prestart_worker_first_driver": False}


def connect(address: str | None, *, num_cpus: int, dashboard: bool = False) -> bool:
    """Join the cluster at `address`, or start a Ray of `num_cpus` logical CPUs on this
    machine; True when this call started Ray (so the caller shuts it down). `dashboard`:
    the Ray started here runs its dashboard and collects metrics (run.dashboard); a cluster
    keeps its own settings."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        check_reachable(address)
        try:
            ray.init(address=address, logging_level="WARNING")
        except Exception as exc:  # ConnectionError, ValueError, ... all mean the same here
            hint = ("" if os.environ.get("RAY_AUTH_MODE") else
                    " (a cluster with token authentication, the default of `ray start`, "
                    "needs RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN or "
                    "~/.ray/auth_token)")
            raise ClusterError(f"--address {address!r}: cannot join the Ray cluster: "
                               f"{type(exc).__name__}: {exc}{hint}") from exc
        return True
    # Token authentication stays on; only Ray's notice that it is on is silenced.
    logging.getLogger(AUTH_NOTICE_LOGGER).setLevel(logging.ERROR)
    # address="local": always a fresh instance of our own, never a `ray start` cluster that
    # happens to run (or to have left its address file) on this machine.
    system_config = {**EMBEDDED_RAY_SYSTEM_CONFIG, "enable_metrics_collection": dashboard}
    context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard,
                       logging_level="WARNING", _system_config=system_config)
    if dashboard:
        url = context.dashboard_url or ""
        token = ("" if os.environ.get("RAY_AUTH_MODE") == "disabled" else
                 " (it asks for Ray's token: ~/.ray/auth_token, or $RAY_AUTH_TOKEN)")
        print(f"stalwart: Ray dashboard at {url if '://' in url else 'http://' + url}{token}",
              flush=True)
    return True


def check_reachable(address: str) -> None:
    """Fail in seconds on a HOST:PORT nothing listens on (ray.init retries for minutes)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # `auto`, ray:// and other forms: Ray's own errors are quick and clear
    if not 1 <= int(port) <= 65535:
        raise ClusterError(f"--address {address!r}: the port must be a number from 1 to 65535")
    check_listening(host, int(port), subject=f"--address {address!r}",
                    hint="start a cluster with `ray start --head` and pass its address, or "
                         "omit --address to start Ray on this machine")


def check_listening(host: str, port: int, *, subject: str, hint: str,
                    timeout_s: float = 5.0) -> None:
    """Fail in seconds, with one error naming `subject` and what to do (`hint`), unless
    something accepts a connection at host:port."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(f"{subject}: nothing answers there ({exc}); {hint}") from None
