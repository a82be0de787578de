"""Run directories holding real DCP checkpoints of the reference task's model, made without
Ray, for tests of the commands that read them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.config import dump_config, load_config
from stalwart.core.task import build_task
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import signing_key


def run_dir_with_checkpoints(tmp_path: Path, steps: tuple[int, ...],
                             overrides: tuple[str, ...] = ()) -> tuple[Path, dict[int, dict]]:
    """A run dir with the reference config and a committed DCP checkpoint of the model at
    each step (different weights per step); returns it and each step's weights."""
    config = load_config(REFERENCE_CONFIG, [*TINY, *overrides])
    run = tmp_path / "run"
    storage = run / "checkpoints"
    storage.mkdir(parents=True)
    (run / "config.toml").write_text(dump_config(config))
    task = build_task(config.task.path, config.task.args)
    weights = {}
    for step in steps:
        torch.manual_seed(step)
        model = task.build_model(config)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dcp.save({"model": state}, storage_writer=FsspecWriter(str(storage / step_dir_name(step))),
                 no_dist=True)
        write_manifest(str(storage), step, {"world_size": 1}, ranks=1, key=signing_key())
        weights[step] = state
    return run, weights
