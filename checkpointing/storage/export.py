"""Export a run's checkpoint as full, unsharded model weights for use outside stalwart.

Runs in one process with no process group, from the checkpoint alone: no task code is
imported. The checkpoint's manifest is verified (signature, listing, sizes) before anything
of it is read, and each file against its sha256 as it is read. Its `.metadata` gives each
model tensor's full shape and dtype, and DCP reads every shard into tensors of that shape.
The output is safetensors (`.safetensors`) or a plain `torch.save` state dict (`.pt`,
`.pth`, `.bin`).

Without a step, the newest checkpoint that verifies and loads is exported; each one passed
over is reported to `on_skip` with the reason. The file is written under a fresh, unique
name next to `--out` (created with O_EXCL, so nothing planted there is followed), then
renamed: `--out` appears whole or not at all, with the mode any new file gets (0644 under the
usual umask 022).
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.checkpointing.errors import CheckpointError, describe_load_error
from stalwart.checkpointing.storage.catalog import CheckpointInfo, find_step, newest_valid
from stalwart.checkpointing.storage.signing import CheckpointTrust
from stalwart.core.safe_files import new_mode

if TYPE_CHECKING:
    import torch

SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")

OnSkip = Callable[[int, str], None]


def check_out(out: Path) -> None:
    """Refuse an output path that cannot be written, before anything is read."""
    if out.suffix not in SUFFIXES:
        raise CheckpointError(f"--out {str(out)!r}: unknown format; use one of {', '.join(SUFFIXES)}")
    check_new_path(out)


def check_new_path(out: Path) -> None:
    """`out` does not exist yet, and can be made: its directory, or the nearest one that
    exists (created at the write), is writable. Nothing is created before the output is
    ready."""
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"--out {str(out)!r} already exists; refusing to overwrite it")
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"--out {str(out)!r}: {str(parent)!r} is not a writable "
                              f"directory")


MODEL_PREFIX = "model."  # the model's entries in a checkpoint: state_dict()["model"]


def load_weights(checkpoint: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The full model tensors of a verified checkpoint, by the model's own names."""
    # torch and DCP load here, once a checkpoint is found: a wrong path, an output that
    # exists or no checkpoint at all fails in a fraction of a second.
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stalwart.checkpointing.safe_load import SafeLoadPlanner, VerifiedReader

    reader = VerifiedReader(checkpoint.path, files=checkpoint.manifest["files"])
    metadata = reader.read_metadata()  # checked against the manifest, then unpickled safely
    claimed = {name.removeprefix(MODEL_PREFIX): meta
               for name, meta in metadata.state_dict_metadata.items()
               if name.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    if not claimed:
        raise CheckpointError(f"checkpoint {checkpoint.path!r} holds no model tensors")
    _check_claimed_sizes(checkpoint, claimed)
    model = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in claimed.items()}
    state = {"model": model}
    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's warning is noise
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    # DCP raises a variety of types for a damaged file, and CheckpointException (a
    # BaseException) for a read that failed: both mean this checkpoint cannot be exported.
    except (CheckpointException, Exception) as exc:
        raise CheckpointError(f"checkpoint {checkpoint.path!r} failed to load: "
                              f"{describe_load_error(exc)}") from exc
    return {k: v.contiguous() for k, v in state["model"].items()}


def _check_claimed_sizes(checkpoint: CheckpointInfo, claimed: dict[str, Any]) -> None:
    """The model tensors `.metadata` claims fit in the bytes the checkpoint holds: a shape
    claimed larger would be allocated before any of it is read (a crafted one is an
    out-of-memory, not an error)."""
    stored = sum(meta["size"] for meta in checkpoint.manifest["files"].values())
    need = sum(math.prod(meta.size) * meta.properties.dtype.itemsize
               for meta in claimed.values())
    if need > stored:
        raise CheckpointError(f"checkpoint {checkpoint.path!r}: .metadata claims model "
                              f"tensors of {need} bytes, more than its files hold ({stored}); "
                              f"not loaded")


def write_weights(weights: dict[str, torch.Tensor], step: int, out: Path) -> Path:
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise CheckpointError(f"--out {str(out)!r}: cannot write there: "
                              f"{exc.strerror or exc}") from None
    os.close(fd)  # mkstemp made it with O_EXCL under a name of its own: nothing planted
    tmp = Path(tmp_name)
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(weights, str(tmp), metadata={"step": str(step)})
        else:
            import torch

            torch.save(weights, tmp)
        # The export is the user's file, as any they write: the private mode (mkstemp's,
        # or the safetensors writer's own 0600) was for the name being written alone.
        tmp.chmod(new_mode())
        tmp.replace(out)
    except OSError as exc:
        raise CheckpointError(f"--out {str(out)!r}: writing it failed: "
                              f"{exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def candidates(storage_url: str, step: int | None, trust: CheckpointTrust, on_skip: OnSkip
               ) -> Iterator[CheckpointInfo]:
    """The checkpoint `step` (verified), or every valid one, newest first."""
    # hashes=False: load_weights checks every file's sha256 as it reads it.
    if step is not None:
        yield find_step(storage_url, step, trust, hashes=False)
        return
    below = None
    while (info := newest_valid(storage_url, trust, on_skip=on_skip, below=below,
                                hashes=False)) is not None:
        yield info
        below = info.step


Write = Callable[[CheckpointInfo, dict[str, "torch.Tensor"], Path], Path]


def write_file(checkpoint: CheckpointInfo, weights: dict[str, torch.Tensor], out: Path) -> Path:
    return write_weights(weights, checkpoint.step, out)


def export_newest(storage_url: str, step: int | None, out: Path, *, trust: CheckpointTrust,
                  on_skip: OnSkip, write: Write = write_file,
                  check: Callable[[Path], None] = check_out) -> tuple[CheckpointInfo, Path]:
    """Export `step`, or the newest checkpoint that verifies and loads; those passed over
    go to `on_skip` (step, why). The checkpoint returned says whether it was unsigned.
    `write` and `check` make the output: one file by default (storage/export_hf.py: a
    Hugging Face directory)."""
    check(out)
    skipped: list[int] = []

    def skip(s: int, why: str) -> None:
        skipped.append(s)
        on_skip(s, why)

    for info in candidates(storage_url, step, trust, skip):
        try:
            weights = load_weights(info)
        except CheckpointError as exc:
            if step is not None:
                raise
            skip(info.step, str(exc))
            continue
        return info, write(info, weights, out)
    if skipped:
        raise CheckpointError(f"no checkpoint under {storage_url} verifies and loads "
                              f"(skipped steps {sorted(skipped)})")
    raise CheckpointError(f"no committed checkpoint under {storage_url}")
