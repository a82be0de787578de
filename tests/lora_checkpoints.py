"""A LoRA fine-tune's committed, signed checkpoint, made without training: a tiny transformers
Llama saved as the base model, LoRA injected in place by peft (lora_B random, so the adapter
changes the model), and a step directory holding the LoRA tensors with the export files and
the manifest's base_model that a fine-tuning task records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.config import dump_config, load_config
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import signing_key

TIED = [["model.embed_tokens.weight", "lm_head.weight"]]


@dataclass
class LoraModel:
    base: Path
    """The base model's directory, as save_pretrained wrote it."""
    model: torch.nn.Module
    """The base model with LoRA injected in place, in eval mode."""
    lora: dict[str, torch.Tensor]
    """The LoRA tensors by the injected model's names: what the checkpoint holds."""
    adapter_config: bytes
    """peft's JSON of the LoraConfig."""


def tiny_llama(*, tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                         max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def lora_model(tmp_path: Path, *, tied: bool, **lora: object) -> LoraModel:
    """The tiny Llama saved under tmp_path/base, then LoRA (r=4, alpha=8 on q_proj and v_proj
    unless `lora` says otherwise) injected with random lora_B."""
    from peft import LoraConfig, inject_adapter_in_model

    base = tmp_path / "base"
    model = tiny_llama(tied=tied)
    model.save_pretrained(base)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                           "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
                           **lora})
    model = inject_adapter_in_model(config, model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    config.save_pretrained(tmp_path / "adapter_config")
    adapter_config = (tmp_path / "adapter_config" / "adapter_config.json").read_bytes()
    lora_tensors = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return LoraModel(base, model.eval(), lora_tensors, adapter_config)


def tokenizer_files(tmp_path: Path) -> dict[str, bytes]:
    """A word-level tokenizer's files over the tiny model's 64 ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 64)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    where = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(where)
    return {p.name: p.read_bytes() for p in where.iterdir()}


def base_model_entry(base: Path) -> dict:
    """The manifest's base_model for the model saved in `base`: its weight files' size and
    sha256."""
    files = {p.name: {"size": p.stat().st_size,
                      "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(base.iterdir())
             if p.name.endswith((".safetensors", ".safetensors.index.json"))}
    return {"source": "tiny-llama", "path": str(base.resolve()), "files": files}


def commit_checkpoint(storage: Path, step: int, weights: dict[str, torch.Tensor],
                      export: dict[str, bytes], extra: dict) -> None:
    """A committed, signed step directory holding `weights` as the model and `export` as its
    export files; `extra` goes into the manifest."""
    step_dir = storage / step_dir_name(step)
    dcp.save({"model": dict(weights)}, storage_writer=FsspecWriter(str(step_dir)), no_dist=True)
    for name, data in export.items():
        (step_dir / f"export.{name}").write_bytes(data)
    write_manifest(str(storage), step, {"world_size": 1, "task": "t:LoRA", **extra},
                   ranks=1, key=signing_key())


def lora_checkpoint(storage: Path, step: int, lm: LoraModel, tmp_path: Path, *,
                    tied: bool) -> None:
    """The checkpoint a LoRA fine-tune of `lm` commits at `step`."""
    export = {"config.json": (lm.base / "config.json").read_bytes(),
              "adapter_config.json": lm.adapter_config, **tokenizer_files(tmp_path)}
    commit_checkpoint(storage, step, lm.lora, export,
                      {"tied": TIED if tied else [], "base_model": base_model_entry(lm.base)})


def run_dir(tmp_path: Path) -> Path:
    """A run directory (the reference config) whose checkpoints go under run/checkpoints."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(dump_config(load_config(REFERENCE_CONFIG, TINY)))
    return run
