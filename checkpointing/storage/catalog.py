"""Finding and validating storage checkpoints from the driver (no process group needed)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.layout import (
    FORMAT_VERSION,
    MANIFEST,
    METADATA,
    check_file_name,
    data_file_rank,
    filesystem,
    join,
    parse_step_dir,
    sha256_of,
    step_dir_name,
)
from stalwart.checkpointing.storage.signing import CheckpointTrust, check_signature


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    """URL of the step directory."""
    manifest: dict[str, Any]
    unsigned: str | None = None
    """Set by verify() when the checkpoint was accepted without a trusted signature
    (--trust-unsigned): why it has none."""

    def files_in_commit_order(self) -> list[str]:
        """Every file of the step directory, the manifest last: a copy made in this order
        is committed only once all its data is there (the manifest is the commit). Checks
        the manifest first: its names are joined under the destination."""
        check_manifest(self)
        return [*sorted(self.manifest["files"]), MANIFEST]


def list_step_dirs(url: str) -> list[tuple[int, bool]]:
    """(step, committed) for every step directory under `url`, oldest first."""
    fs, root = filesystem(url)
    if not fs.exists(root):
        return []
    out = []
    for info in fs.ls(root, detail=True):
        step = parse_step_dir(info["name"])
        if step is None or info["type"] != "directory":
            continue
        out.append((step, fs.exists(f"{info['name'].rstrip('/')}/{MANIFEST}")))
    return sorted(out)


def read_checkpoint(url: str, step: int) -> CheckpointInfo:
    return read_step_dir(join(url, step_dir_name(step)), step=step)


def read_step_dir(path: str, *, step: int | None = None) -> CheckpointInfo:
    """The committed checkpoint in the step directory `path`. Its step is the manifest's,
    which must equal the one the directory's name gives (when it gives one)."""
    fs, root = filesystem(path)
    where = f"step {step} under {path.rsplit('/', 1)[0]!r}" if step is not None else repr(path)
    try:
        with fs.open(f"{root}/{MANIFEST}", "r") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} is not committed (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is damaged: "
                              f"{type(exc).__name__}: {exc}") from None
    except OSError as exc:  # a directory named manifest.json, no permission, ...
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} cannot be read: "
                              f"{exc.strerror or exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is damaged: a JSON "
                              f"{type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT_VERSION:
        older = (" (written by an older stalwart; export it with that version)"
                 if manifest.get("format") == 1 else "")
        raise CheckpointError(f"checkpoint {path!r}: manifest format "
                              f"{manifest.get('format')!r}, expected {FORMAT_VERSION}{older}")
    named = manifest.get("step")
    if not isinstance(named, int) or isinstance(named, bool) or named < 0:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} names no step")
    if step is None:
        step = parse_step_dir(root)
    if step is not None and named != step:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is for step {named}, "
                              f"not the directory's step {step}")
    info = CheckpointInfo(step=named, path=path, manifest=manifest)
    check_manifest(info)
    return info


def check_manifest(info: CheckpointInfo) -> None:
    """The manifest has the shape a commit writes and lists every file a load needs:
    `.metadata` and a data file of every rank that wrote the checkpoint."""
    where = f"checkpoint {info.path!r}: {MANIFEST}"
    files = info.manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{where} lists no files")
    for name, meta in files.items():
        try:
            check_file_name(name)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        if name in (MANIFEST, f"{MANIFEST}.tmp"):
            raise CheckpointError(f"{where} lists itself as a data file")
        if (not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str)
                or not isinstance(meta.get("size"), int) or isinstance(meta["size"], bool)):
            raise CheckpointError(f"{where}: the entry of {name} has no size and sha256")
    missing = [] if METADATA in files else [METADATA]
    ranks = info.manifest.get("ranks")  # absent in manifests written before it was recorded
    if ranks is not None:
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise CheckpointError(f"{where}: ranks is {ranks!r}, not a positive integer")
        written = {data_file_rank(name) for name in files}
        missing += [f"a data file of rank {r} (__{r}_0.distcp)" for r in range(ranks)
                    if r not in written]
    if missing:
        raise CheckpointError(f"{where} is incomplete: it lists no {', no '.join(missing)}")


def committed_checkpoints(url: str) -> list[CheckpointInfo]:
    return [read_checkpoint(url, step) for step, done in list_step_dirs(url) if done]


def verify(info: CheckpointInfo, trust: CheckpointTrust, *, hashes: bool = True
           ) -> CheckpointInfo:
    """Check that the manifest lists every file a load needs and is signed as `trust`
    requires, then every file's size, and with `hashes` its sha256, against it; raise
    naming the first problem. Nothing of the checkpoint is deserialised here. Returns
    `info`, marked when it was accepted unsigned.

    `hashes=False` is for a checkpoint about to be loaded: the loader checks each file's
    sha256 as it reads it (safe_load.VerifiedReader), so reading it all here first would
    read it twice and still not cover a change in between."""
    check_manifest(info)
    unsigned = check_signature(info.manifest, trust, f"checkpoint {info.path!r}")
    _check_files(info, hashes=hashes)
    return dataclasses.replace(info, unsigned=unsigned)


def verify_files(info: CheckpointInfo) -> None:
    """Every file of the manifest is there with its size and sha256 (the manifest's own
    trust is verify()'s to check)."""
    check_manifest(info)
    _check_files(info)


def _check_files(info: CheckpointInfo, *, hashes: bool = True) -> None:
    """Each file against the size and sha256 the (already checked) manifest gives."""
    fs, root = filesystem(info.path)
    for name, meta in info.manifest["files"].items():
        path = f"{root}/{name}"
        if not fs.isfile(path):
            raise CheckpointError(f"checkpoint {info.path!r}: file {name} is missing")
        if fs.size(path) != meta["size"] or (hashes and sha256_of(fs, path) != meta["sha256"]):
            raise CheckpointError(f"checkpoint {info.path!r}: file {name} is damaged "
                                  f"(size or sha256 differs from the manifest)")


def newest_valid(url: str, trust: CheckpointTrust, *, on_skip=None, below: int | None = None,
                 hashes: bool = True) -> CheckpointInfo | None:
    """The newest committed checkpoint (older than step `below`, if given) that verifies;
    damaged and untrusted ones are skipped and reported. `hashes`: see verify."""
    for step, done in reversed(list_step_dirs(url)):
        if not done or (below is not None and step >= below):
            continue
        try:
            return verify(read_checkpoint(url, step), trust, hashes=hashes)
        except CheckpointError as exc:
            if on_skip is not None:
                on_skip(step, str(exc))
    return None


def find_step(url: str, step: int, trust: CheckpointTrust, *, hashes: bool = True
              ) -> CheckpointInfo:
    """A specific committed, verified checkpoint; the error lists the steps that exist.
    `hashes`: see verify."""
    steps = [s for s, done in list_step_dirs(url) if done]
    if step not in steps:
        raise CheckpointError(f"no committed checkpoint for step {step} under {url!r}; "
                              f"committed steps: {steps or 'none'}")
    return verify(read_checkpoint(url, step), trust, hashes=hashes)
