"""GPTTask: the reference task. A small GPT learns Python from the standard library's source.

Every machine with Python has this data, so the quickstart needs no download. `[task.args]`
in the config sets the model's shape (any GPTConfig field: d_model, n_layers, seq_len, ...)
and `val_fraction`, the share of stdlib files held out for the validation loss.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.core.errors import TaskError
from stalwart.core.task import ModelDims, SequenceShard, TrainTask
from stalwart.examples.gpt.data import (
    TokenDataset,
    TokenFiles,
    build_token_files,
    split_sizes,
)
from stalwart.examples.gpt.model import GPT, GPTConfig, GPTConfigError
from stalwart.examples.gpt.pipeline import GPTStage, rank_union, split_stages
from stalwart.examples.gpt.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import JobConfig
    from stalwart.parallel.dims import ParallelDims


# The data are bytes: every token id up to 255 occurs.
BYTE_VOCAB = 256


class GPTTask(TrainTask):
    config_class: type[GPTConfig] = GPTConfig
    """The model's config, built from [task.args] (a subclass's model has its own)."""

    def __init__(self, *, val_fraction: float = 0.02, **model_args: Any) -> None:
        # build_task constructs the task on the driver before anything starts, so every
        # argument is checked here, with its config key in the message (see docs/tasks.md).
        allowed = {f.name for f in dataclasses.fields(self.config_class)}
        unknown = sorted(set(model_args) - allowed)
        if unknown:
            raise TaskError(f"unknown key task.args.{unknown[0]}; allowed: val_fraction, "
                            f"{', '.join(sorted(allowed))}")
        self.val_fraction = _check_val_fraction(val_fraction)
        try:
            self.model_config = self.config_class(**model_args)
        except GPTConfigError as exc:
            raise TaskError(f"task.args.{exc.field} = {exc.value!r} is invalid: "
                            f"{exc.allowed}") from None
        if self.model_config.vocab_size < BYTE_VOCAB:
            raise TaskError(f"task.args.vocab_size = {self.model_config.vocab_size} is invalid: "
                            f"must be >= {BYTE_VOCAB} (the tokens are bytes)")
        self._files: TokenFiles | None = None

    def _token_files(self, config: JobConfig) -> TokenFiles:
        if self._files is None:
            cache = Path(config.data.cache_dir).expanduser() / "gpt-stdlib"
            self._files = build_token_files(cache, val_fraction=self.val_fraction)
        return self._files

    def prepare_data(self, config: JobConfig) -> None:
        self._token_files(config)  # tokenizes once per machine; later calls find the cache

    def build_model(self, config: JobConfig) -> GPT:
        return GPT(self.model_config)

    def model_dims(self, model: GPT) -> ModelDims:
        cfg = self.model_config
        return ModelDims(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                         seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, ffn_hidden=cfg.ffn_dim,
                         block_params=sum(p.numel() for p in model.layers[0].parameters()))

    def check_layout(self, dims: ParallelDims) -> None:
        super().check_layout(dims)
        dims.check_model(n_heads=self.model_config.n_heads, n_layers=self.model_config.n_layers,
                         seq_len=self.model_config.seq_len)
        if dims.pp > 1 and self.model_config.tie_embeddings:
            raise TaskError(f"parallel.pp = {dims.pp} needs task.args.tie_embeddings = false: "
                            f"the embedding and the output head live on different stages")

    def split_pipeline(self, model: GPT, stage_ids: list[int], num_stages: int
                       ) -> tuple[list[GPTStage], GPTStage]:
        return (split_stages(model, stage_ids, num_stages),
                rank_union(model, stage_ids, num_stages))

    def apply_tensor_parallel(self, model: GPT, tp_mesh: DeviceMesh, *,
                              sequence_parallel: bool) -> None:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)

    def apply_context_parallel(self, model: GPT, shard: SequenceShard) -> None:
        model.set_context(shard)

    def train_dataset(self, config: JobConfig) -> TokenDataset:
        return TokenDataset(self._token_files(config).train, self.model_config.seq_len)

    def val_dataset(self, config: JobConfig) -> TokenDataset:
        return TokenDataset(self._token_files(config).val, self.model_config.seq_len)


def _check_val_fraction(value: Any) -> float:
    """task.args.val_fraction: a number in (0, 1) that leaves files on both sides."""
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or not 0 < value < 1):
        raise TaskError(f"task.args.val_fraction = {value!r} is invalid: must be a number "
                        f"between 0 and 1 (exclusive)")
    n_train, n_val = split_sizes(value)
    if not n_train or not n_val:
        raise TaskError(f"task.args.val_fraction = {value!r} is invalid: it puts {n_val} of "
                        f"{n_train + n_val} standard-library files in validation; both "
                        f"splits must be non-empty")
    return float(value)
