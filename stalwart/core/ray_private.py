"""Every private Ray API stalwart uses, in one place, each with why and the Ray it was read from.

Ray's public API has no way to do these things. Each function says what it stands in for and
what happens if the private name moves: none of them may break a run. All were checked against
Ray 2.60.0. Ray is imported inside each function, so the basement stays light to import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Ray's loggers that announce what stalwart reports itself (token auth, runtime_env uploads).
AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
PACKAGING_LOGGER = "ray._private.runtime_env.packaging"


def rays_pynvml() -> Any | None:
    """The copy of NVML's Python bindings that Ray ships (`ray._private.thirdparty.pynvml`,
    what Ray reads GPUs with), for a node without nvidia-ml-py installed. None if it moved
    or Ray is missing: the GPU health check then skips its NVML part."""
    try:
        from ray._private.thirdparty import pynvml
    except Exception:  # ImportError, or whatever a half-installed Ray raises
        return None
    return pynvml


def actor_row(actor: Any) -> dict[str, Any]:
    """The GCS actor table's row for an actor handle: its Pid (non-zero once a worker process
    is leased to it) and Address.NodeID. The public state API needs the dashboard; this reads
    the GCS the driver is already connected to. Raises whatever Ray raises if it moved."""
    from ray._private import state

    return state.actors(actor._actor_id.hex())


def draining_nodes() -> set[str]:
    """Ids of the nodes Ray is draining (preemption, autoscaler scale-down). If the private
    call moves, the set is empty and a drain is noticed as a node death instead."""
    try:
        from ray._private import state

        return set(state.state.get_draining_nodes())
    except Exception:
        return set()


def drain_node(node_id: str, *, reason: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask the GCS to drain a node for preemption, as a cloud provider's notice would (the
    fault injector's `drain`). `ray drain-node` is the CLI's only public path to it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    preemption = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    return gcs.drain_node(node_id, preemption, reason, deadline_ms)


def actor_name_log_marker() -> str | None:
    """The line prefix by which Ray's log monitor learns an actor's display name (its
    `:actor_name:` line). None if the constant moved: the prefix then stays the name given at
    creation."""
    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME
    except ImportError:
        return None
    return LOG_PREFIX_ACTOR_NAME


def route_driver_printing(route: Callable[[dict[str, Any]], Any | None]) -> bool:
    """Have Ray's driver print each batch of lines to the file `route(batch)` names instead of
    its console (None: the console, as Ray does). A batch is Ray's dict: `pid` is the
    process's id, or "raylet", "gcs_server" or "autoscaler" for Ray's daemons and for the
    errors the raylet and GCS publish (a worker that died, a node marked dead). Ray prints
    every batch through ray._private.worker.print_worker_logs, looked up at each call, from
    both of its printing threads. Called again, the new route replaces the old. False if the
    name moved: Ray then prints everything as it does."""
    try:
        from ray._private import worker
    except Exception:  # moved, or a half-installed Ray
        return False
    printer = getattr(worker, "print_worker_logs", None)
    if printer is None:
        return False
    original = getattr(printer, "stalwart_original", printer)

    def routed(data: dict[str, Any], print_file: Any, ignore_prefix: bool = False) -> None:
        sink = route(data)
        original(data, print_file if sink is None else sink, ignore_prefix)

    routed.stalwart_original = original  # type: ignore[attr-defined]
    worker.print_worker_logs = routed
    return True


def job_auth_headers() -> dict[str, str]:
    """The headers Ray's own Jobs client sends when the cluster requires a token, for the
    dashboard probe stalwart makes before it (Ray's client has no timeout on its requests)."""
    from ray._private.authentication.http_token_authentication import (
        get_auth_headers_if_auth_enabled,
    )

    return get_auth_headers_if_auth_enabled({})


def walk_working_dir(root: Path, excludes: list[str], handler: Callable[[Path], None], *,
                     logger: logging.Logger) -> None:
    """Walk `root` as Ray does when it packs a runtime_env's working_dir: its default
    excludes, then `excludes`, and .gitignore files unless Ray's environment switch turns them
    off. So `submit --dry-run` lists exactly what Ray will upload. Composed as
    ray._private.runtime_env.working_dir.upload_working_dir_if_needed composes it."""
    import os

    from ray._private import ray_constants
    from ray._private.runtime_env import packaging

    patterns = ray_constants.get_runtime_env_default_excludes() + list(excludes)
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE,
                                       "0") != "1"
    packaging._dir_travel(root, [packaging._get_excludes(root, patterns)], handler,
                          include_gitignore=include_gitignore, logger=logger)


def tune_trial_storage() -> tuple[Any, str] | None:
    """The running Tune trial's storage filesystem (pyarrow) and its trial path, from Tune's
    session; None if the private session moved (the caller then uses the public trial dir)."""
    try:
        from ray.train._internal.session import get_session

        storage = get_session().storage
        return storage.storage_filesystem, storage.trial_fs_path
    except Exception:
        return None


@contextmanager
def ray_auto_start_off() -> Iterator[None]:
    """Ray's automatic start off while it lasts: the task's code that the driver tries before
    the run's Ray is up (its dataset) must not start a Ray of its own with Ray's defaults, as
    a lazy Ray Data pipeline's first call does. The public switch, RAY_ENABLE_AUTO_CONNECT=0,
    is read once, when Ray is imported; this sets the flag it sets. If the flag moved, Ray
    may start itself as before."""
    try:
        from ray._private import auto_init_hook
    except Exception:  # moved, or a half-installed Ray
        yield
        return
    saved = getattr(auto_init_hook, "enable_auto_connect", True)
    auto_init_hook.enable_auto_connect = False
    try:
        yield
    finally:
        auto_init_hook.enable_auto_connect = saved


def restored_run_config(tuner: Any) -> Any | None:
    """The RunConfig a Tuner restored from an experiment will run with (Tune restores it from
    the experiment's tuner.pkl, output options included; `Tuner._local_tuner` holds it), so
    that `stalwart sweep --resume` prints as this command asks. None if it moved: the resumed
    sweep then prints as it did when it started."""
    try:
        return tuner._local_tuner.get_run_config()
    except Exception:
        return None
