"""Export a LoRA fine-tune's checkpoint: the adapter as peft saves it (`stalwart export
--format peft`), or merged into its base model's weights (`--format hf --merge`).

The checkpoint of a LoRA fine-tune holds the trainable tensors only, named as the model with
LoRA injected in place names them (`X.lora_A.default.weight`, `X.lora_B.default.weight` for
a Linear layer `X`). Its `export.adapter_config.json` is peft's own LoraConfig JSON, and its
manifest's `base_model` says where the base model's weight files were at training and their
size and sha256.

The adapter directory is `adapter_config.json` as signed, `adapter_model.safetensors` under
peft's saved names (`base_model.model.` + the name without the adapter's `.default`), and
the tokenizer's files: `peft.PeftModel.from_pretrained(base, DIR)` loads it. The merged
model is the base model's tensors under the base files' own names, each LoRA layer's weight
replaced by W + scaling * (B @ A), computed in float32 and cast back to W's dtype; it is
written as `--format hf` writes a model.

Only plain LoRA on Linear layers is exported: a feature whose tensors this does not carry
(DoRA, biases, modules_to_save, trainable tokens) or that changed the base weights at
initialisation (PiSSA, OLoRA, LoftQ, ...) is refused by name, and so is, for a merge, one
whose forward pass a merged weight does not reproduce. No task code and, until a checkpoint
is found, no torch is imported.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.export_hf import (
    ADAPTER_CONFIG,
    export_files_of,
    write_hf,
    write_new_dir,
)
from stalwart.checkpointing.storage.layout import check_file_name, sha256_of

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel's wrapping adds in front of the model's names
LORA_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<half>[AB])\.default\.weight")

# Set (truthy, or bias other than "none"), each means tensors beyond the A and B of Linear
# layers, or base weights that are not the base model's files: neither format is right.
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "replicated layers (layer_replication)",
}
# Set, each changes the forward pass in a way a merged weight does not reproduce.
MERGE_UNSUPPORTED = {
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "megatron_config": "Megatron layers (megatron_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "velora_config": "VeLoRA (velora_config)",
}
# init_lora_weights values that leave the base weights as the base model's files hold them.
PLAIN_INITS = (True, False, "gaussian")


def adapter_config(checkpoint: CheckpointInfo, files: dict[str, bytes], *, merge: bool
                   ) -> dict[str, Any]:
    """The checkpoint's LoRA config (its `export.adapter_config.json`), once it is one this
    exporter handles."""
    if ADAPTER_CONFIG not in files:
        how = "with --format hf, without --merge" if merge else "with --format hf"
        raise CheckpointError(f"checkpoint step {checkpoint.step} holds no LoRA adapter (a "
                              f"full fine-tune?): export it {how}")
    try:
        config = json.loads(files[ADAPTER_CONFIG])
    except ValueError as exc:
        raise CheckpointError(f"checkpoint step {checkpoint.step}: {ADAPTER_CONFIG} is not "
                              f"JSON ({exc})") from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        raise CheckpointError(f"checkpoint step {checkpoint.step}: {ADAPTER_CONFIG} is no "
                              f"LoRA config (peft_type {kind!r}); only LoRA adapters are "
                              f"exported")
    check_supported(config, merge=merge)
    return config


def check_supported(config: dict[str, Any], *, merge: bool) -> None:
    """Refuse, naming them, the LoRA features this export does not carry over faithfully."""
    found = [what for key, what in UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        found.append(f"trained biases (bias={config['bias']!r})")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        found.append(f"an initialisation that changes the base weights "
                     f"(init_lora_weights={init!r})")
    if merge:
        found += [what for key, what in MERGE_UNSUPPORTED.items() if config.get(key)]
    if found:
        to = "merged" if merge else "exported"
        raise CheckpointError(f"the LoRA adapter uses {', '.join(found)}, which cannot be {to} "
                              f"here; only plain LoRA on Linear layers is supported")


def lora_pairs(weights: dict[str, torch.Tensor]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each LoRA layer's (A, B) by the layer's module name; any other tensor is refused."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        match = LORA_NAME.fullmatch(name)
        if match is None or tensor.dim() != 2:
            raise CheckpointError(
                f"the checkpoint holds {name!r} (shape {list(tensor.shape)}), which is no "
                f"LoRA A or B weight of a Linear layer (X.lora_A.default.weight, "
                f"X.lora_B.default.weight); only plain LoRA on Linear layers is exported")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    if not halves:
        raise CheckpointError("the checkpoint holds no LoRA weights")
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            missing = "B" if "A" in half else "A"
            raise CheckpointError(f"LoRA layer {module!r} has no lora_{missing} weight in the "
                                  f"checkpoint")
        a, b = half["A"], half["B"]
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"LoRA layer {module!r}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} differ in rank")
        pairs[module] = (a, b)
    return pairs


def peft_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA tensors under the names `PeftModel.save_pretrained` writes."""
    return {f"{PEFT_PREFIX}{module}.lora_{half}.weight": tensor
            for module, (a, b) in lora_pairs(weights).items()
            for half, tensor in (("A", a), ("B", b))}


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """`rank_pattern` / `alpha_pattern` as peft resolves them: the first key that matches
    the end of the module's name, at a name boundary (a regex), else `default`."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """The factor peft multiplies B @ A by for `module`: alpha / r, or alpha / sqrt(r) with
    rsLoRA; r and alpha per the config's patterns."""
    r = pattern_value(config.get("rank_pattern") or {}, module, config.get("r"))
    alpha = pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha"))
    for key, value in (("r", r), ("lora_alpha", alpha)):
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{ADAPTER_CONFIG}: {key} of {module!r} is {value!r}, not a "
                                  f"positive number")
    if r != rank:
        raise CheckpointError(f"LoRA layer {module!r} has rank {rank} in the checkpoint, but "
                              f"{ADAPTER_CONFIG} gives it r={r}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merge_lora(base: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`base` with each LoRA layer X's `X.weight` replaced by W + scaling * (B @ A), in
    float32, cast back to W's dtype (transposed delta for fan_in_fan_out layers)."""
    import torch

    check_supported(config, merge=True)
    merged = dict(base)
    for module, (a, b) in lora_pairs(weights).items():
        name = f"{module}.weight"
        if name not in base:
            raise CheckpointError(f"LoRA layer {module!r} has no weight {name!r} in the base "
                                  f"model's files (tied to another, or named otherwise)")
        w = base[name]
        delta = b.to(torch.float32) @ a.to(torch.float32)
        if config.get("fan_in_fan_out"):
            delta = delta.T
        if delta.shape != w.shape:
            raise CheckpointError(f"LoRA layer {module!r}: B @ A is {list(delta.shape)}, the "
                                  f"base weight {name!r} {list(w.shape)}")
        merged[name] = (w.to(torch.float32) + scaling(config, module, a.shape[0]) * delta
                        ).to(w.dtype)
    return merged


def base_model_files(checkpoint: CheckpointInfo) -> list[Path]:
    """The base model's safetensors files, each checked against the size and sha256 the
    checkpoint's manifest recorded at training."""
    entry = checkpoint.manifest.get("base_model")
    if (not isinstance(entry, dict) or not isinstance(entry.get("path"), str)
            or not isinstance(entry.get("files"), dict) or not entry["files"]):
        raise CheckpointError(f"checkpoint step {checkpoint.step} records no base model (its "
                              f"manifest has no base_model with a path and files): nothing "
                              f"to merge the adapter into; export it alone with --format peft")
    root = Path(entry["path"])
    source = entry.get("source", entry["path"])
    changed = (f"the base model changed since training; put back the one trained on "
               f"(source {source!r}) to merge, or export the adapter alone with --format peft")
    if not root.is_dir():
        raise CheckpointError(f"base model {str(root)!r} is not a directory: {changed}")
    for name, meta in entry["files"].items():
        try:
            path = root / check_file_name(name)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint step {checkpoint.step}: base_model: {exc}"
                                  ) from None
        if not isinstance(meta, dict) or not {"size", "sha256"} <= set(meta):
            raise CheckpointError(f"checkpoint step {checkpoint.step}: base_model: the entry "
                                  f"of {name} has no size and sha256")
        if not path.is_file():
            raise CheckpointError(f"base model {str(root)!r}: {name} is missing: {changed}")
        if path.stat().st_size != meta["size"] or \
                sha256_of(fsspec.filesystem("file"), str(path)) != meta["sha256"]:
            raise CheckpointError(f"base model {str(root)!r}: {name} differs in size or "
                                  f"sha256 from the one training read: {changed}")
    names = sorted(n for n in entry["files"] if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"base model {str(root)!r}: the manifest lists no .safetensors "
                              f"weight files of it; only safetensors weights are merged")
    return [root / n for n in names]


def read_base_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the base model's files, by the files' own names, one file at a time."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in weights:
                        raise CheckpointError(f"base model: {name!r} is in more than one "
                                              f"weight file (again in {path.name})")
                    weights[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"base model file {str(path)!r} is no safetensors file: "
                                  f"{exc}") from None
    return weights


def write_peft(checkpoint: CheckpointInfo, weights: dict[str, torch.Tensor], out: Path
               ) -> Path:
    """`out`, a peft adapter directory: adapter_config.json, adapter_model.safetensors and
    the tokenizer's files (every export file but the base model's config.json)."""
    from safetensors.torch import save_file

    files = export_files_of(checkpoint)
    adapter_config(checkpoint, files, merge=False)
    tensors = peft_state_dict(weights)
    metadata = {"format": "pt", "step": str(checkpoint.step)}

    def fill(tmp: Path) -> None:
        for name, data in files.items():
            if name != "config.json":
                (tmp / name).write_bytes(data)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata=metadata)

    return write_new_dir(out, fill)


def write_merged(checkpoint: CheckpointInfo, weights: dict[str, torch.Tensor], out: Path, *,
                 max_shard_bytes: int) -> Path:
    """`out`, a Hugging Face model directory of the base model with the adapter merged in."""
    files = export_files_of(checkpoint)
    config = adapter_config(checkpoint, files, merge=True)
    lora_pairs(weights)  # refuse foreign tensors before the base model is read
    merged = merge_lora(read_base_weights(base_model_files(checkpoint)), weights, config)
    del files[ADAPTER_CONFIG]  # a merged model is no adapter
    return write_hf(checkpoint, merged, out, max_shard_bytes=max_shard_bytes, files=files)
