"""Export a checkpoint as a Hugging Face model directory (`stalwart export --format hf`), which
`AutoModelForCausalLM.from_pretrained(DIR)` loads.

From the checkpoint alone, as the flat export: no task code is imported. What the format needs
besides the weights (config.json, the tokenizer's files) is in the checkpoint as `export.*`
files, written by the task's `export_files` and signed with the weights. The weights keep the
model's own parameter names; of each group of tied parameters (the manifest's `tied`) only the
first is stored, as `save_pretrained` does. Past `max_shard_bytes` the weights are split into
`model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`. A LoRA
fine-tune's checkpoint (it carries `adapter_config.json`) holds the adapter alone and is
refused here: storage/export_peft.py exports it, alone or merged into its base model.

The directory is built under a fresh name next to `--out`, then renamed: it appears whole or
not at all, and an existing one is never touched.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.export import check_new_path
from stalwart.checkpointing.storage.layout import EXPORT_PREFIX, check_file_name, filesystem
from stalwart.core.safe_files import new_mode

if TYPE_CHECKING:
    import torch

DEFAULT_SHARD = "5GB"
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter's, as peft writes it


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes; a ValueError saying what is allowed."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() or "B" if match else ""
    if not match or unit not in UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size: a positive number with an optional unit "
                         f"({', '.join(UNITS)}), e.g. 5GB")
    return int(float(match.group(1)) * UNITS[unit])


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that exists or cannot be made, before anything is read."""
    check_new_path(out)


def export_files_of(checkpoint: CheckpointInfo) -> dict[str, bytes]:
    """The checkpoint's `export.*` files by their own names, each checked against the
    signed manifest as it is read."""
    from stalwart.checkpointing.safe_load import checked

    fs, root = filesystem(checkpoint.path)
    files = checkpoint.manifest["files"]
    return {check_file_name(name.removeprefix(EXPORT_PREFIX)):
            checked(fs.cat(f"{root}/{name}"), meta, f"checkpoint {checkpoint.path!r}: {name}")
            for name, meta in files.items() if name.startswith(EXPORT_PREFIX)}


def untied(weights: dict[str, torch.Tensor], tied: list[list[str]]) -> dict[str, torch.Tensor]:
    """The weights with each tied group stored once, under its first name."""
    dropped = {name for group in tied for name in group[1:]}
    return {k: v for k, v in weights.items() if k not in dropped}


def shard(weights: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_hf(checkpoint: CheckpointInfo, weights: dict[str, torch.Tensor], out: Path, *,
             max_shard_bytes: int, files: dict[str, bytes] | None = None) -> Path:
    """`out`, a model directory: `files` (default: the checkpoint's export files) and the
    weights, sharded past `max_shard_bytes`."""
    if files is None:
        files = export_files_of(checkpoint)
        if ADAPTER_CONFIG in files:
            # Its weights are the adapter's alone: config.json beside them would promise a
            # whole model that from_pretrained cannot build.
            raise CheckpointError(
                f"checkpoint step {checkpoint.step} holds a LoRA adapter, not a whole model: "
                f"export it merged into its base model with --format hf --merge, or alone "
                f"with --format peft")
    if "config.json" not in files:
        raise CheckpointError(
            f"checkpoint step {checkpoint.step} has no Hugging Face config.json: its task "
            f"({checkpoint.manifest.get('task', 'unknown')}) returns none from export_files, "
            f"so it is no Hugging Face model; export it with --out FILE.safetensors")
    tied = checkpoint.manifest.get("tied") or []
    weights = untied(weights, tied)

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        for name, data in files.items():
            (tmp / name).write_bytes(data)
        metadata = {"format": "pt", "step": str(checkpoint.step)}
        parts = shard(weights, max_shard_bytes)
        if len(parts) == 1:
            save_file(parts[0], str(tmp / SINGLE), metadata=metadata)
            return
        weight_map = {}
        for i, part in enumerate(parts, start=1):
            name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, str(tmp / name), metadata=metadata)
            weight_map.update(dict.fromkeys(part, name))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        (tmp / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total, "step": checkpoint.step},
             "weight_map": weight_map}, indent=2))

    return write_new_dir(out, fill)


def write_new_dir(out: Path, fill: Callable[[Path], None]) -> Path:
    """Make the directory `out` as `fill` writes it: into a fresh directory next to `out`,
    renamed once whole. An existing `out` is refused and never touched."""
    check_out_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise CheckpointError(f"--out {str(out)!r}: cannot write there: "
                              f"{exc.strerror or exc}") from None
    try:
        fill(tmp)
        # mkdtemp's directory is private (0700); the model directory is as any other.
        for path in [tmp, *tmp.iterdir()]:
            path.chmod(new_mode(directory=path.is_dir()))
        tmp.rename(out)
    except OSError as exc:
        raise CheckpointError(f"--out {str(out)!r}: writing it failed: "
                              f"{exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
