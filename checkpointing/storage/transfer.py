"""Copying a committed checkpoint between storages (any two fsspec URLs), the way a commit
writes one: every data file first, the manifest last, then every checksum verified.

Used to start a run from a checkpoint that lives elsewhere (another run's, or one Ray Tune
holds for a trial), and to hand a run's checkpoint to Tune. The copy is what the run's
workers read, so they only ever need to see the run's own storage.
"""

from __future__ import annotations

from stalwart.checkpointing.storage.catalog import CheckpointInfo, read_step_dir, verify_files
from stalwart.checkpointing.storage.layout import (
    MANIFEST,
    filesystem,
    join,
    step_dir_name,
    write_manifest_file,
)
from stalwart.checkpointing.storage.signing import SIGNED_FIELDS_EXCLUDE, SigningKey, sign


def copy_checkpoint(info: CheckpointInfo, dest: str, *, as_step_dir: bool = True,
                    adopt: tuple[SigningKey, str] | None = None) -> CheckpointInfo:
    """Copy `info` into `dest` (as `dest/step_XXXXXXXXX`, or into `dest` itself) and return
    the copy, its files checked. A copy that fails part-way has no manifest, so it is never
    loaded.

    `adopt` (key, run id): the copy becomes that run's own, its manifest re-signed naming
    the run and where it was copied from. The caller has verified `info` first."""
    target = join(dest, step_dir_name(info.step)) if as_step_dir else dest
    src_fs, src_root = filesystem(info.path)
    dst_fs, dst_root = filesystem(target)
    if dst_fs.exists(f"{dst_root}/{MANIFEST}"):
        raise FileExistsError(f"{target} already holds a committed checkpoint")
    dst_fs.makedirs(dst_root, exist_ok=True)
    names = info.files_in_commit_order()
    for name in names if adopt is None else names[:-1]:
        with src_fs.open(f"{src_root}/{name}", "rb") as src, \
                dst_fs.open(f"{dst_root}/{name}", "wb") as dst:
            for block in iter(lambda: src.read(1 << 22), b""):  # noqa: B023 (read at once)
                dst.write(block)
    if adopt is not None:
        key, run_id = adopt
        body = {k: v for k, v in info.manifest.items() if k not in SIGNED_FIELDS_EXCLUDE}
        write_manifest_file(dst_fs, dst_root, sign({**body, "run_id": run_id,
                                                    "copied_from": info.path}, key))
    copy = read_step_dir(target, step=info.step)
    verify_files(copy)
    return copy
