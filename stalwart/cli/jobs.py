"""Ray Jobs for stalwart: a `stalwart run` handed to a cluster's job API, and the job found again.

The job is Ray's (`ray.job_submission.JobSubmissionClient`), so `ray job status/logs/stop` and
the dashboard see it like any other. This module adds what a training run needs on top:
- the address of the job API, taken like `ray job` takes it, but an explicit one always wins;
- the task checked here as the job's `stalwart run` would check it before Ray starts
  (`check_task_here`), before the cluster is contacted;
- a check, in seconds and before anything is uploaded, that the cluster answers, accepts our
  token and runs this machine's Ray version (the config is checked here, against this
  machine's stalwart and Ray; the job runs on the cluster's, and a difference would show late,
  inside the job);
- the entrypoint: `stalwart run CONFIG --address auto --run-dir ABSOLUTE_DIR ...`. A job runs in
  a temporary copy of the working directory, so a relative run dir would vanish with it;
- a stop that checkpoints: Ray stops a job with SIGTERM (RAY_JOB_STOP_SIGNAL, Ray's default,
  set all the same so that the cluster's own default cannot change it), which `stalwart run`
  answers as it does Ctrl-C, and waits `failure.stop_timeout_s` + STOP_MARGIN_S before SIGKILL
  (RAY_JOB_STOP_WAIT_TIME_S). SIGTERM rather than SIGINT: it is what a scheduler, `ray job
  stop` and a deleted RayJob send too, so every stop takes the one path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from stalwart.checkpointing.storage.signing import DEFAULT_KEY_FILE
from stalwart.cli.upload import SECRET_EXCLUDES, secret_files_in
from stalwart.cluster import check_listening
from stalwart.core.config import FailureConfig
from stalwart.core.errors import ClusterError, ConfigError
from stalwart.core.ray_private import PACKAGING_LOGGER

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient

    from stalwart.core.config import JobConfig

# Where `ray job` looks for the job API when --address is not given, in this order.
ADDRESS_ENV_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Seconds a stopped job has, after its own stop deadline (failure.stop_timeout_s), to stop its
# workers and exit before Ray's SIGKILL (Ray's default wait is 3 s in all; the previous
# committed checkpoint survives a kill anyway).
STOP_MARGIN_S = 60
CONNECT_TIMEOUT_S = 5.0
# What a job never needs from the working directory: environments, VCS data, caches, runs and
# checkpoints (large, and a job writes its own run dir by absolute path), sweeps (the state
# `stalwart sweep` keeps in ./sweeps, and Tune's pickled experiment state wherever a sweep's
# storage put it: `sweep --resume` unpickles it, so it never travels), deploy/local's state
# directory (it holds the cluster's token; one elsewhere holds a `.rayignore` of `*`), and
# credentials of every kind (upload.SECRET_EXCLUDES). Gitignore-style patterns.
WORKING_DIR_EXCLUDES = (
    ".git/", ".venv/", "venv/", ".ci-venv/", "__pycache__/", "*.pyc", "*.egg-info/",
    ".pytest_cache/", ".ruff_cache/", "runs/", "checkpoints/", "bench/results/",
    # anchored: a package of the project's own may be called `sweeps`
    "/sweeps/", "tuner.pkl", "experiment_state-*.json",
    ".local-cluster/", *SECRET_EXCLUDES,
)


# ---------------------------------------------------------------------------- the job


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One `stalwart run` as a Ray job: what is submitted, and how to continue it later."""

    config: PurePosixPath
    """The config file, relative to the working directory (the job's copy has it there)."""
    run_dir: Path
    """Absolute: the job's working directory is a temporary copy."""
    overrides: tuple[str, ...] = ()
    injects: tuple[str, ...] = ()
    resume: bool = False
    auto_resume: bool = False
    """run.auto_resume (--auto-resume): the job, and every command that continues it, resumes
    when the run dir holds a checkpoint of the run and starts it otherwise."""
    stop_timeout_s: float = FailureConfig().stop_timeout_s
    trust_unsigned: bool = False

    def _args(self, command: str, *, address: str | None, resume: bool,
              injects: tuple[str, ...] = ()) -> str:
        args = ["stalwart", command, str(self.config), "--run-dir", str(self.run_dir)]
        args += [a for o in self.overrides for a in ("--set", o)]
        args += [a for f in injects for a in ("--inject", f)]
        if self.auto_resume and not self.resume:  # --resume (strict) wins over the config key
            args += ["--auto-resume"]
        elif resume:
            args += ["--resume"]
        args += ["--trust-unsigned"] if self.trust_unsigned else []
        args += ["--address", address] if address else []
        return shlex.join(args)  # every user value quoted: a --set may hold spaces or quotes

    def entrypoint(self) -> str:
        """The job's shell command: a run on the cluster the job runs on (RAY_ADDRESS there)."""
        return self._args("run", address="auto", resume=self.resume, injects=self.injects)

    def resume_commands(self, address: str) -> list[str]:
        """Commands that continue this run from its newest checkpoint, as a job on the cluster at
        `address` or with Ray on this machine (no fault is injected again)."""
        return [self._args("submit", address=address, resume=True),
                self._args("run", address=None, resume=True)]

    def runtime_env(self, cwd: Path, storage: str,
                    environ: Mapping[str, str] | None = None) -> dict[str, object]:
        excludes = [*WORKING_DIR_EXCLUDES, *_named_secret_files(cwd, environ)]
        # The run's own files, wherever under the working directory they are kept.
        for path in (self.run_dir, Path(storage) if "://" not in storage else None):
            if path is not None and path.is_absolute() and path.is_relative_to(cwd):
                excludes.append(f"/{path.relative_to(cwd).as_posix()}/")
        return {"working_dir": str(cwd), "excludes": excludes,
                "env_vars": {"RAY_JOB_STOP_SIGNAL": "SIGTERM",
                             "RAY_JOB_STOP_WAIT_TIME_S": str(self.stop_wait_s)}}

    @property
    def stop_wait_s(self) -> int:
        """Seconds Ray waits after the stop signal before it SIGKILLs the job."""
        return _stop_wait_s(self.stop_timeout_s)


def secret_excludes(cwd: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """The excludes that keep credentials back: their usual names, whatever file in cwd
    $RAY_AUTH_TOKEN_PATH, $STALWART_CHECKPOINT_KEY_FILE and the like name, and the default
    checkpoint key file if it is there."""
    return [*SECRET_EXCLUDES, *_named_secret_files(cwd, environ)]


def _named_secret_files(cwd: Path, environ: Mapping[str, str] | None) -> list[str]:
    return secret_files_in(cwd, os.environ if environ is None else environ,
                           named=(DEFAULT_KEY_FILE,))


def _stop_wait_s(stop_timeout_s: float) -> int:
    return math.ceil(stop_timeout_s) + STOP_MARGIN_S


def stop_wait_of(job: JobDetails) -> int:
    """The stop wait a job was submitted with (as its metadata says; else the default's)."""
    try:
        return int((job.metadata or {})["stalwart_stop_wait_s"])
    except (KeyError, ValueError):  # a job from before this was recorded, or not ours
        return _stop_wait_s(FailureConfig().stop_timeout_s)


def config_in(config: str | Path, cwd: Path) -> PurePosixPath:
    """CONFIG relative to the working directory, which is all the job receives."""
    path = (cwd / config).resolve()
    if not path.is_relative_to(cwd):
        raise ConfigError(f"config file {str(config)!r} is outside the working directory {cwd}, "
                          f"which is what a job ships to the cluster; run `stalwart submit` "
                          f"from a directory that contains it")
    return PurePosixPath(path.relative_to(cwd).as_posix())


def check_storage(storage: str) -> None:
    """A relative checkpoint.storage would land in the job's temporary working directory."""
    if storage and "://" not in storage and not Path(storage).is_absolute():
        raise ConfigError(f"checkpoint.storage {storage!r} is a relative path, and a job runs in "
                          f"a temporary copy of the working directory; give an absolute path "
                          f"or a URL every node can write, or leave it empty (<run dir>/"
                          f"checkpoints)")


def check_task_here(config: JobConfig, cwd: Path) -> None:
    """What the job's `stalwart run` checks of its task before Ray starts, done here before
    the cluster is contacted: the task imports from the working directory the job ships (and
    so do its dependencies, installed here as they must be on the cluster), its constructor
    takes task.args, it accepts the layout, and its model builds (task.check, as far as
    `build`: the data is read where the job runs, by the job's own check). A task error is
    raised as `stalwart run` raises it; a note is printed."""
    # Found as the job's `stalwart run` finds it in its copy of this directory: appended, so
    # a file here never shadows a library.
    if str(cwd) not in sys.path:
        sys.path.append(str(cwd))
    from stalwart.core.task import resolve_task
    from stalwart.parallel.dims import ParallelDims
    from stalwart.task_check import check_task

    task = resolve_task(config.task.path, config.task.args)
    task.check_layout(ParallelDims.from_config(config.parallel, config.scaling.num_workers))
    note = check_task(task, config, where="submit")
    if note is not None:
        print(note, flush=True)


def absolute_run_dir(run_dir: str | Path | None, default: Path, cwd: Path) -> Path:
    """--run-dir (default runs/<run.name>-<timestamp>) against the submitter's cwd.

    Right on a cluster that shares this machine's filesystem (deploy/local); on another
    cluster --run-dir must be a path its nodes can write (a shared volume).
    """
    return (cwd / (run_dir if run_dir is not None else default)).resolve()


# ---------------------------------------------------------------------------- the cluster


def resolve_address(flag: str | None, environ: dict[str, str] | None = None) -> str:
    """The job API's URL: --address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS."""
    environ = os.environ if environ is None else environ
    source, address = "--address", flag
    if address is None:
        source, address = next(((f"${v}", environ[v]) for v in ADDRESS_ENV_VARS
                                if environ.get(v)), (None, None))
    if address is None:
        raise ClusterError("no cluster given: pass --address http://HEAD:8265 (the head's "
                           "dashboard), or set RAY_API_SERVER_ADDRESS; deploy/local's "
                           "`. DIR/env` sets it")
    try:
        url = urlsplit(address)
    except ValueError as exc:  # an unclosed IPv6 bracket, ...
        raise ClusterError(f"{source} {address!r} is not a URL ({exc}): pass --address "
                           f"http://HEAD:8265 (the head's dashboard)") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ClusterError(f"{source} {address!r} is not the http(s) URL of a cluster's job API: "
                           f"pass --address http://HEAD:8265 (the head's dashboard; "
                           f"`stalwart run --address` takes the HOST:PORT of Ray itself)")
    try:
        port = url.port  # urllib parses it only when asked, and raises on a bad one
    except ValueError:
        port = 0
    if port == 0 or (port is None and url.netloc.endswith(":")):
        raise ClusterError(f"{source} {address!r}: the port must be a number from 1 to 65535, "
                           f"e.g. http://HEAD:8265")
    return address.rstrip("/")


def check_cluster(address: str, *, local_version: str | None = None) -> str:
    """Fail in seconds, before any upload, unless the job API answers us with our Ray version.

    Returns the cluster's Ray version. (JobSubmissionClient's own requests have no timeout,
    and it only checks that the cluster's Ray is new enough.)
    """
    import requests

    from stalwart.core.ray_private import job_auth_headers

    if local_version is None:
        import ray

        local_version = ray.__version__
    url = urlsplit(address)
    port = url.port or (443 if url.scheme == "https" else 80)
    check_listening(url.hostname, port, subject=f"--address {address}",
                    hint="start a cluster (deploy/local/up.sh) and pass its head's dashboard "
                         "address, http://HEAD:8265", timeout_s=CONNECT_TIMEOUT_S)
    # The headers JobSubmissionClient sends: the token when RAY_AUTH_MODE=token.
    headers = job_auth_headers()
    try:
        response = requests.get(f"{address}/api/version", headers=headers,
                                timeout=(CONNECT_TIMEOUT_S, 30))
    except requests.RequestException as exc:
        raise ClusterError(f"--address {address}: no Ray job API answers there "
                           f"({type(exc).__name__}: {exc})") from None
    if response.status_code in (401, 403):
        raise ClusterError(_token_problem(address, response.status_code, bool(headers)))
    try:
        response.raise_for_status()
        cluster_version = response.json()["ray_version"]
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"--address {address}: not a Ray job API (GET /api/version: "
                           f"HTTP {response.status_code}, {type(exc).__name__}: {exc})") from None
    if cluster_version != local_version:
        raise ClusterError(f"the cluster at {address} runs Ray {cluster_version} and this "
                           f"machine Ray {local_version}; a job needs the same Ray on both "
                           f"(install ray=={cluster_version} here, or run the cluster on Ray "
                           f"{local_version})")
    return cluster_version


def _token_problem(address: str, status: int, sent: bool) -> str:
    if not sent:
        return (f"the cluster at {address} uses token authentication (HTTP {status}) and no "
                f"token was sent: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's "
                f"token (deploy/local: `. DIR/env`)")
    return (f"the cluster at {address} refused the token (HTTP {status}): RAY_AUTH_TOKEN (or "
            f"RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) must hold this cluster's token "
            f"(deploy/local: `. DIR/env`)")


@contextmanager
def _api_server_address(address: str) -> Iterator[None]:
    """JobSubmissionClient lets $RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS, replace its address
    argument; the address resolved here (which already honoured them) must win."""
    saved = os.environ.get(ADDRESS_ENV_VARS[0])
    os.environ[ADDRESS_ENV_VARS[0]] = address
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ADDRESS_ENV_VARS[0]]
        else:
            os.environ[ADDRESS_ENV_VARS[0]] = saved


def job_client(address: str) -> JobSubmissionClient:
    """A Ray Jobs API client for the cluster at `address` (its dashboard answered first)."""
    check_cluster(address)
    from ray.job_submission import JobSubmissionClient

    # The SDK announces every upload at INFO; stalwart prints what matters itself.
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                 PACKAGING_LOGGER):
        logging.getLogger(name).setLevel(logging.WARNING)
    with _api_server_address(address):
        try:
            return JobSubmissionClient(address)
        except (ConnectionError, RuntimeError) as exc:  # it answered check_cluster a moment ago
            raise ClusterError(f"--address {address}: {exc}") from None


# ---------------------------------------------------------------------------- jobs


def submit(client: JobSubmissionClient, spec: JobSpec, *, cwd: Path, storage: str,
           job_id: str | None = None) -> str:
    try:
        return client.submit_job(
            entrypoint=spec.entrypoint(), submission_id=job_id,
            runtime_env=spec.runtime_env(cwd, storage),
            # Read back by `stalwart status` and `stalwart stop`.
            metadata={"stalwart_run_dir": str(spec.run_dir),
                      "stalwart_stop_wait_s": str(spec.stop_wait_s)})
    except (RuntimeError, ValueError) as exc:  # the job API's refusal, or an upload too large
        raise ClusterError(f"the cluster at {client.get_address()} refused the job: "
                           f"{exc}") from None


def find(client: JobSubmissionClient, job_id: str) -> JobDetails:
    """The job's details; an id the cluster does not know is a clear error."""
    try:
        return client.get_job_info(job_id)
    except RuntimeError as exc:  # the SDK reports a 404 like any other failed request
        known = {i for job in client.list_jobs() for i in (job.submission_id, job.job_id)}
        if job_id not in known:
            raise ClusterError(f"the cluster at {client.get_address()} has no job {job_id!r} "
                               f"(`ray job list` lists its jobs)") from None
        raise ClusterError(f"job {job_id}: {exc}") from None


def follow(client: JobSubmissionClient, job_id: str, write: Callable[[str], object]) -> str:
    """Stream the job's output until it ends; returns its final status.

    Ctrl-C (KeyboardInterrupt) ends the streaming here, not the job.
    """
    import aiohttp

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)

    try:
        asyncio.run(tail())
    except (RuntimeError, OSError, aiohttp.ClientError) as exc:  # the head went away, ...
        raise ClusterError(f"lost the output stream of job {job_id} ({exc}); the job may still "
                           f"run: `stalwart status {job_id}`") from None
    return wait_for_end(client, job_id, timeout_s=30)


def wait_for_end(client: JobSubmissionClient, job_id: str, *, timeout_s: float) -> str:
    """The job's status once it is terminal, or as it is after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (status := str(find(client, job_id).status.value)) not in TERMINAL:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return status
