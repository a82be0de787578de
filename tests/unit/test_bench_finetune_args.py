"""bench/finetune.py's job, without a run: its TOML is the LoRA fine-tune on 2 DDP workers it
claims, and its baseline (bench/peers/finetune_peft.py) reads exactly the packed rows that
stalwart prepared and follows stalwart's learning-rate schedule. No timing is asserted."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stalwart.core.config import load_config
from stalwart.core.task import TrainTask

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

pytest.importorskip("peft")


def small_args() -> argparse.Namespace:
    return argparse.Namespace(hidden=32, layers=1, rows=40, seq_len=64, lora_r=4, steps=12,
                              global_batch=8, micro_batch=2, log_every=4)


def test_the_job_is_a_lora_ddp_run_and_the_baseline_reads_stalwarts_rows(tmp_path: Path) -> None:
    from bench import finetune
    from bench.peers import finetune_peft

    path, tokens_per_step, prepared = finetune.make_job(tmp_path, small_args())
    config = load_config(path)
    assert config.task.path == "stalwart.tasks.hf:CausalLM"
    assert config.task.args["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert config.scaling.num_workers == 2 and config.scaling.spare_workers == 0
    assert (config.parallel.dp_replicate, config.parallel.dp_shard) == (2, 1)
    assert config.checkpoint.persist_every > config.train.steps
    assert config.data.val_every == 0 and config.run.progress is False
    assert tokens_per_step == 8 * 64
    rows = finetune_peft.packed_rows(config.task.args, config.data.cache_dir)
    assert rows.path.parent == Path(prepared) and len(rows) > 0


def test_the_baseline_schedule_is_stalwarts() -> None:
    import torch

    from bench.peers.finetune_peft import schedule

    config = load_config(None, ["train.steps=30", "train.warmup_steps=5",
                                "train.min_lr_ratio=0.1", "train.lr=1.0"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    stalwart = TrainTask.build_lr_scheduler(None, optimizer, config)  # self is unused
    factor = schedule(30, 5, 0.1)
    for step in range(30):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(factor(step)), step
        optimizer.step()
        stalwart.step()
