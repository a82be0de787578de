"""A pretrained Hugging Face model on disk: found, checked, built on the meta device, and
loaded rank by rank from its safetensors.

The model is built with its parameters on the meta device (no memory, no initialisation)
and its buffers for real (rotary frequencies and the like are computed, not stored). The
engine parallelises it, allocates only this rank's shards, and calls `load_weights`, which
reads exactly those slices from the safetensors through DCP (slice_reader.py): no rank
ever holds the whole model unless its layout replicates it (DDP).

A hub id is resolved to a local snapshot (`huggingface_hub`): fetched once, on the driver,
into `hub_cache`; workers find it there (a cache every node reads), or, on a node without it,
fetch the same revision themselves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from stalwart.checkpointing.storage.layout import sha256_of
from stalwart.core.errors import TaskError

if TYPE_CHECKING:
    import torch

WEIGHT_SUFFIX = ".safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]


def resolve_model(source: str, *, revision: str = "", cache_dir: str = "") -> Path:
    """The local directory of `source`: a directory as it is, or a hub id's snapshot
    (downloaded once where the network allows, else found in the cache)."""
    path = Path(source).expanduser()
    if path.is_dir() or source.startswith((".", "/", "~")) or source.count("/") > 1:
        if not path.is_dir():
            raise TaskError(f"task.args.model = {source!r}: no such directory")
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise TaskError(f"task.args.model = {source!r} is no local directory, and a hub id "
                        f"needs huggingface_hub: pip install 'stalwart[hf]'") from None
    kwargs: dict[str, Any] = {"allow_patterns": HUB_PATTERNS, "revision": revision or None,
                              "cache_dir": os.path.expanduser(cache_dir) if cache_dir else None}
    try:  # the cache first: the driver fetched it, and workers must not each ask the hub
        return Path(snapshot_download(source, local_files_only=True, **kwargs))
    except Exception:
        pass
    try:
        return Path(snapshot_download(source, **kwargs))
    except Exception as exc:  # offline, unknown repo, gated: the hub's own message says which
        raise TaskError(f"task.args.model = {source!r} is no local directory, not in the hub "
                        f"cache ({cache_dir or 'Hugging Face default'}) and cannot be fetched "
                        f"from the Hugging Face hub ({type(exc).__name__}: {exc}); give a "
                        f"local directory in Hugging Face layout") from None


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files, or a TaskError saying what the directory lacks."""
    where = f"task.args.model: {path}"
    if not (path / "config.json").is_file():
        raise TaskError(f"{where} has no config.json: a model directory in Hugging Face "
                        f"layout is needed (config.json, *.safetensors, tokenizer files)")
    files = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIX) and p.is_file())
    if not files:
        legacy = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (f" (it has {', '.join(legacy)}: convert them with save_pretrained("
                f"safe_serialization=True))" if legacy else "")
        raise TaskError(f"{where} has no *.safetensors weights{hint}")
    return files


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's shape, from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:
            raise TaskError(f"task.args.model: {file} is not a readable safetensors file "
                            f"({type(exc).__name__}: {exc})") from None
    return shapes


def base_name(name: str) -> str:
    """A parameter's name in the base model's files: LoRA wraps a layer as `base_layer`."""
    return name.replace(".base_layer.", ".")


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The base model's tensors as the files must hold them: each tied group once (by its
    first name), adapters left out."""
    shapes: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or "lora_" in name:
            continue
        seen.add(id(param))
        shapes[base_name(name)] = tuple(param.shape)
    for name, buffer in model.named_buffers():
        if name in model.state_dict():  # persistent buffers are stored too
            shapes[base_name(name)] = tuple(buffer.shape)
    return shapes


def check_weights(model: torch.nn.Module, path: Path) -> None:
    """The files hold every tensor the config's model has, each in its shape."""
    stored = stored_shapes(path)
    for name, shape in expected_shapes(model).items():
        if name not in stored:
            raise TaskError(f"task.args.model: the weights in {path} have no tensor {name!r}, "
                            f"which its config.json's model needs (the files hold "
                            f"{len(stored)} tensors, e.g. {sorted(stored)[:3]})")
        if stored[name] != shape:
            raise TaskError(f"task.args.model: tensor {name!r} in {path} has shape "
                            f"{list(stored[name])}, but its config.json makes it {list(shape)}")


def build_on_meta(path: Path, *, lora: Any | None = None) -> torch.nn.Module:
    """The model of `path`'s config.json with its parameters on the meta device (buffers
    real), ties in place and LoRA adapters injected (also on meta)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise TaskError(f"task.args.model: {path}/config.json cannot be read "
                        f"({type(exc).__name__}: {exc})") from None
    # fp32 parameters whatever dtype the files hold: they are the master weights (bf16
    # compute is parallel.mixed_precision's), and FSDP2 needs one dtype per unit, adapters
    # included. A bf16 file is converted as it is read.
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                     dtype=torch.float32)
        except ValueError as exc:
            raise TaskError(f"task.args.model: {path} is no causal language model that "
                            f"transformers knows: {exc}") from None
    # init_empty_weights gives each module its own meta parameter, which unties tied ones.
    model.tie_weights()
    model.config.use_cache = False
    if lora is not None:
        from peft import inject_adapter_in_model

        with init_empty_weights(include_buffers=False):
            model = inject_adapter_in_model(lora, model)
    return model


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Collective over the world: read this rank's slices of the base weights into the
    materialised model (any wrapping: DDP, FSDP2, TP). Adapters are not touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from stalwart.parallel.data_parallel import unwrapped

    state = get_model_state_dict(model)
    wanted = expected_shapes(unwrapped(model))
    targets = {base_name(k): v for k, v in state.items() if base_name(k) in wanted}
    from stalwart.tasks.slice_reader import SliceReader

    dcp.load(targets, storage_reader=SliceReader(str(path)))


def identity(source: str, path: Path, cache_dir: str) -> dict[str, Any]:
    """The base model as a checkpoint records it: what the user gave, where it was, and
    every weight file's size and sha256. Hashes are cached by (path, size, mtime), so a
    model is hashed once per machine, not at every start."""
    cache = Path(cache_dir).expanduser() / "model-hashes.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    files: dict[str, dict[str, Any]] = {}
    changed = False
    for file in [*weight_files(path), path / WEIGHT_INDEX]:
        if not file.is_file():
            continue
        st = file.stat()
        key = f"{file}:{st.st_size}:{st.st_mtime_ns}"
        if key not in known:
            known[key] = sha256_of(fsspec.filesystem("file"), str(file))
            changed = True
        files[file.name] = {"size": st.st_size, "sha256": known[key]}
    if changed:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(cache)
        except OSError:
            pass  # a cache that cannot be written only costs the next start a re-hash
    return {"source": source, "path": str(path), "files": files}


def same_base(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """One base model: the same weight files, byte for byte (wherever they are now)."""
    return {k: v.get("sha256") for k, v in (recorded.get("files") or {}).items()} == \
        {k: v["sha256"] for k, v in current["files"].items()}


def export_files(path: Path) -> dict[str, bytes]:
    """config.json, generation_config.json and the tokenizer's files (those its cache key
    reads) as they are in the model directory."""
    from stalwart.data.token_cache import TOKENIZER_FILES

    names = ("config.json", "generation_config.json", *TOKENIZER_FILES)
    return {name: (path / name).read_bytes() for name in names if (path / name).is_file()}
