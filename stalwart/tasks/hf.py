"""CausalLM: fine-tune a pretrained Hugging Face causal language model on your own data.

    [task]
    path = "stalwart.tasks.hf:CausalLM"
    args = { model = "DIR or hub id", data = "PATH, URL or glob", lora = { r = 8, alpha = 16 } }

The model comes from a directory in Hugging Face layout (or a hub id, fetched once): built
on the meta device, parallelised (DDP, FSDP2, HSDP, TP), each rank reading only its slices
of the safetensors (tasks/pretrained.py). With a `lora` table only peft adapters train, and
checkpoints hold only them plus the base model's identity (its files' sha256), so a resume
against other base weights is refused. Data: chat rows, prompt/completion rows or plain text,
tokenized once and packed (stalwart/data/). Every argument is checked on the driver, before
any worker starts. See docs/finetune.md.

Needs `pip install 'stalwart[hf]'`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stalwart.core.errors import TaskError
from stalwart.core.task import Dataset, Layout, ModelDims, TrainTask
from stalwart.parallel.blocks import blocks_of
from stalwart.tasks import lora as lora_lib
from stalwart.tasks import pretrained

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import JobConfig

NEEDS_HF = ("stalwart.tasks.hf:CausalLM needs transformers, peft and accelerate: "
            "pip install 'stalwart[hf]'")
PACKING = ("auto", "pack", "concat", "pad")
ROWS_CHECKED = 100  # rows the driver reads to check the data's shape before workers start


class CausalLM(TrainTask):
    def __init__(self, *, model: str, data: str, lora: dict[str, Any] | bool | None = None,
                 seq_len: int = 512, packing: str = "auto", val_data: str = "",
                 val_fraction: float = 0.05, revision: str = "", hub_cache: str = "",
                 sample_prompts: list[str] | None = None, sample_tokens: int = 32) -> None:
        if any(importlib.util.find_spec(m) is None
               for m in ("transformers", "peft", "accelerate", "safetensors")):
            raise TaskError(NEEDS_HF)
        _check_args(model=model, data=data, seq_len=seq_len, packing=packing,
                    val_data=val_data, val_fraction=val_fraction,
                    sample_prompts=sample_prompts, sample_tokens=sample_tokens)
        self.sample_prompts, self.sample_tokens = sample_prompts or [], sample_tokens
        self.source, self.data, self.val_data = model, data, val_data
        self.seq_len, self.val_fraction = seq_len, float(val_fraction)
        # lora = false: a full fine-tune (TOML has no null to unset a table with --set).
        self.lora = None if lora in (None, False) else lora_lib.lora_config(lora, source=model)
        self.path = pretrained.resolve_model(model, revision=revision, cache_dir=hub_cache)
        meta = self._meta_model()  # refuses a bad directory, weights or target modules
        pretrained.check_weights(meta, self.path)
        self.hf_config = meta.config
        blocks = blocks_of(meta)
        # What a block holds, for the layout checks (which run at every world's start).
        self._block_modules = {n for n, _ in blocks[0].named_modules()} if blocks else set()
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and seq_len > limit:
            raise ValueError(f"task.args.seq_len = {seq_len} is above the model's maximum "
                             f"(max_position_embeddings = {limit} in {self.path}/config.json)")
        self.packing = self._check_data(packing)
        self._prepared: Path | None = None
        self._identity: dict[str, Any] | None = None
        self._tokenizer: Any = None

    # ------------------------------------------------------------------ checks

    def _meta_model(self) -> torch.nn.Module:
        pretrained.weight_files(self.path)
        try:
            return pretrained.build_on_meta(self.path, lora=self.lora)
        except ValueError as exc:  # peft: target modules that match nothing
            if self.lora is None:
                raise
            raise lora_lib.check_targets(pretrained.build_on_meta(self.path),
                                         self.lora) from exc

    def _check_data(self, packing: str) -> str:
        """The data's files, the shape of its first rows, and that the tokenizer can render
        them; returns the packing mode (auto: concat for plain text, else pack)."""
        from stalwart.data.render import check_tokenizer
        from stalwart.data.rows import data_files, read_rows, row_kind
        from stalwart.data.token_cache import load_tokenizer

        kinds: set[str] = set()
        for field, value in (("task.args.data", self.data), ("task.args.val_data", self.val_data)):
            if not value:
                continue
            for i, row in enumerate(read_rows(data_files(value, field=field))):
                if i == ROWS_CHECKED:
                    break
                kinds.add(row_kind(row))
        tokenizer = load_tokenizer(str(self.path))
        check_tokenizer(tokenizer, kinds, f"task.args.model: {self.path}")
        if packing == "auto":
            return "concat" if kinds == {"text"} else "pack"
        return packing

    def check_layout(self, dims: Layout) -> None:
        super().check_layout(dims)
        if dims.pp > 1:
            self._check_pipeline(dims)
        if dims.tp > 1:
            if self.lora is not None:
                raise TaskError(f"parallel.tp = {dims.tp}: LoRA adapters are not split over "
                                f"tensor-parallel ranks yet; use DDP or FSDP (dp_shard) for "
                                f"a LoRA fine-tune")
            c = self.hf_config
            heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or \
                c.num_attention_heads
            if heads % dims.tp or kv % dims.tp:
                raise TaskError(f"parallel.tp = {dims.tp} must divide the model's attention "
                                f"heads ({heads}) and key/value heads ({kv})")
            self._check_tp_names()

    def _check_pipeline(self, dims: Layout) -> None:
        c = self.hf_config
        stages = dims.pp * getattr(dims, "stages_per_rank", 1)
        if getattr(c, "tie_word_embeddings", False):
            raise TaskError(f"parallel.pp = {dims.pp}: the model in {self.path} ties its "
                            f"output head to its embedding (tie_word_embeddings), which sit "
                            f"on the first and the last stage: it cannot be pipelined")
        if self.sample_prompts:
            raise TaskError(f"parallel.pp = {dims.pp}: task.args.sample_prompts needs the "
                            f"whole model on every rank to generate; leave them out")
        if c.num_hidden_layers < stages:
            raise TaskError(f"parallel.pp = {dims.pp}: {stages} stages need as many layers; "
                            f"the model has {c.num_hidden_layers}")
        self._check_block_names(("self_attn", "mlp"), "parallel.pp")

    def _check_tp_names(self) -> None:
        from stalwart.tasks.hf_tensor_parallel import COLWISE, ROWWISE

        self._check_block_names(COLWISE + ROWWISE, "parallel.tp")

    def _check_block_names(self, wanted: tuple[str, ...], field: str) -> None:
        missing = [n for n in wanted if n not in self._block_modules]
        if missing:
            raise TaskError(f"{field}: the model in {self.path} has no {missing[0]} in its "
                            f"blocks; CausalLM splits Llama-style blocks only "
                            f"({', '.join(wanted)})")

    # ------------------------------------------------------------------ model

    def build_model(self, config: JobConfig) -> torch.nn.Module:
        """On the meta device: the engine allocates it shard by shard, then init_weights."""
        return pretrained.build_on_meta(self.path, lora=self.lora)

    def init_weights(self, model: torch.nn.Module) -> None:
        """The base weights from the model's files (this rank's slices), then the adapters'
        first values from the seeded RNG."""
        pretrained.load_weights(model, self.path)
        if self.lora is not None:
            lora_lib.init_adapters(model)

    def apply_tensor_parallel(self, model: torch.nn.Module, tp_mesh: DeviceMesh, *,
                              sequence_parallel: bool) -> None:
        from stalwart.tasks.hf_tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)

    def split_pipeline(self, model: torch.nn.Module, stage_ids: list[int], num_stages: int
                       ) -> tuple[list[torch.nn.Module], torch.nn.Module]:
        from stalwart.tasks.hf_pipeline import rank_union, split_stages

        return (split_stages(model, stage_ids, num_stages),
                rank_union(model, stage_ids, num_stages))

    def model_dims(self, model: torch.nn.Module) -> ModelDims:
        c = self.hf_config
        return ModelDims(n_layers=c.num_hidden_layers, d_model=c.hidden_size,
                         n_heads=c.num_attention_heads, seq_len=self.seq_len,
                         vocab_size=c.vocab_size,
                         ffn_hidden=getattr(c, "intermediate_size", None))

    # ------------------------------------------------------------------ data

    def prepare_data(self, config: JobConfig) -> None:
        """Tokenize and pack the data once per machine (cached by the tokenizer's and the
        data's content)."""
        from stalwart.data.token_cache import prepare

        self.checkpoint_identity(config)  # rank 0 records it at every world's setup
        self._prepared = prepare(data=self.data, val_data=self.val_data or None,
                                 val_fraction=self.val_fraction, tokenizer_dir=str(self.path),
                                 seq_len=self.seq_len, mode=self.packing,
                                 cache_dir=config.data.cache_dir)

    def _data_dir(self, config: JobConfig) -> Path:
        if self._prepared is None:
            self.prepare_data(config)
        assert self._prepared is not None
        return self._prepared

    def train_dataset(self, config: JobConfig) -> Dataset:
        return self._rows(config, self._data_dir(config) / "train")

    def val_dataset(self, config: JobConfig) -> Dataset | None:
        split = self._data_dir(config) / "val"
        return self._rows(config, split) if split.is_dir() else None

    def _rows(self, config: JobConfig, split: Path) -> Dataset:
        """The packed rows: as dict batches for the model's own loss, or as (inputs,
        targets) pairs for a pipeline, whose last stage computes output_loss."""
        from stalwart.data.token_cache import PackedRows

        rows = PackedRows(split)
        if config.parallel.pp > 1:
            from stalwart.tasks.hf_pipeline import PipelineRows

            return PipelineRows(rows)
        return rows

    @torch.no_grad()
    def validation_samples(self, model: torch.nn.Module) -> list[dict[str, str]]:
        """Greedy completions of `sample_prompts` (as a user turn through the chat template
        where the tokenizer has one), the same on every rank."""
        if not self.sample_prompts:
            return []
        from stalwart.data.token_cache import load_tokenizer
        from stalwart.parallel.data_parallel import unwrapped

        if self._tokenizer is None:  # once: every validation step samples
            self._tokenizer = load_tokenizer(str(self.path))
        tokenizer = self._tokenizer
        inner = unwrapped(model)  # DDP: generate on the model itself
        device = next(inner.parameters()).device
        samples = []
        for prompt in self.sample_prompts:
            if tokenizer.chat_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
            else:
                ids = tokenizer(prompt)["input_ids"]
            inputs = torch.tensor([ids], device=device)
            out = inner.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                 max_new_tokens=self.sample_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=tokenizer.pad_token_id
                                 if tokenizer.pad_token_id is not None
                                 else tokenizer.eos_token_id)
            samples.append({"prompt": prompt, "text": tokenizer.decode(
                out[0, inputs.shape[1]:], skip_special_tokens=True)})
        return samples

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_identity(self, config: JobConfig) -> dict[str, Any]:
        """The base model's weight files (sha256), in every checkpoint's manifest. Hashed
        once per process (prepare_data does it at warm-up, before any world forms)."""
        if self._identity is None:
            self._identity = {"base_model": pretrained.identity(self.source, self.path,
                                                                config.data.cache_dir)}
        return self._identity

    def check_checkpoint(self, manifest: dict[str, Any], config: JobConfig) -> None:
        recorded = manifest.get("base_model")
        current = self.checkpoint_identity(config)["base_model"]
        if not isinstance(recorded, dict) or not pretrained.same_base(recorded, current):
            was = (f"{recorded.get('source')!r} ({recorded.get('path')})"
                   if isinstance(recorded, dict) else "no recorded base model")
            raise TaskError(f"checkpoint step {manifest.get('step')} was trained on base model "
                            f"{was}, but task.args.model is {self.source!r} ({self.path}), "
                            f"whose weight files differ: an adapter or fine-tune restores "
                            f"only onto the weights it was trained from")

    def export_files(self, config: JobConfig) -> dict[str, bytes]:
        """config.json and the tokenizer (from the model directory); the adapter's
        adapter_config.json with LoRA."""
        files = pretrained.export_files(self.path)
        if self.lora is not None:
            files["adapter_config.json"] = lora_lib.adapter_config_json(self.lora)
        return files


def _check_args(*, model: Any, data: Any, seq_len: Any, packing: Any, val_data: Any,
                val_fraction: Any, sample_prompts: Any, sample_tokens: Any) -> None:
    """Each argument's type and range (a ValueError naming it); the files come after."""
    for name, value in (("model", model), ("data", data)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"task.args.{name} = {value!r} is invalid: a non-empty string")
    if not isinstance(val_data, str):
        raise ValueError(f"task.args.val_data = {val_data!r} is invalid: a path, URL or glob")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"task.args.seq_len = {seq_len!r} is invalid: an int >= 2")
    if packing not in PACKING:
        raise ValueError(f"task.args.packing = {packing!r} is invalid: one of "
                         f"{', '.join(PACKING)}")
    if not isinstance(val_fraction, int | float) or isinstance(val_fraction, bool) \
            or not 0 <= val_fraction < 1:
        raise ValueError(f"task.args.val_fraction = {val_fraction!r} is invalid: a number "
                         f"in [0, 1)")
    prompts = sample_prompts or []
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"task.args.sample_prompts = {sample_prompts!r} is invalid: a list "
                         f"of non-empty strings")
    if not isinstance(sample_tokens, int) or isinstance(sample_tokens, bool) \
            or not 1 <= sample_tokens <= 4096:
        raise ValueError(f"task.args.sample_tokens = {sample_tokens!r} is invalid: an int "
                         f"from 1 to 4096")
