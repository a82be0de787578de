"""Export a run's checkpoint as full, unsharded model weights for use outside stalwart.

Runs in one process with no process group: DCP reads every shard and reassembles the full
tensors into a freshly built model. The output is safetensors (`.safetensors`) or a plain
`torch.save` state dict (`.pt`, `.pth`, `.bin`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import CheckpointInfo, find_step, newest_valid

SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def export_weights(model: torch.nn.Module, checkpoint: CheckpointInfo, out: Path) -> Path:
    if out.suffix not in SUFFIXES:
        raise CheckpointError(f"--out {str(out)!r}: unknown format; use one of {', '.join(SUFFIXES)}")
    if out.exists():
        raise CheckpointError(f"--out {str(out)!r} already exists; refusing to overwrite it")
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, storage_reader=FsspecReader(checkpoint.path), no_dist=True)
    except Exception as exc:  # DCP raises a variety of types for a mismatched model
        raise CheckpointError(f"checkpoint {checkpoint.path!r} does not fit the run's model: "
                              f"{type(exc).__name__}: {exc}") from exc
    # Tied parameters share storage; safetensors refuses shared tensors, so each key gets
    # its own copy (the file then holds e.g. both the embedding and the output head).
    weights = {k: v.detach().clone().contiguous() for k, v in state["model"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(tmp), metadata={"step": str(checkpoint.step)})
    else:
        torch.save(weights, tmp)
    tmp.replace(out)
    return out


def pick_checkpoint(storage_url: str, step: int | None) -> CheckpointInfo:
    if step is not None:
        return find_step(storage_url, step)
    info = newest_valid(storage_url)
    if info is None:
        raise CheckpointError(f"no committed checkpoint under {storage_url}")
    return info
