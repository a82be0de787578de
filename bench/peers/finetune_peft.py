"""The baseline of bench/finetune.py: a LoRA fine-tune written by hand with transformers, peft
and torch DDP, run under torchrun (gloo, CPU, one thread a rank).

It reads the job's TOML for its settings and trains what stalwart trains: the same packed
rows (stalwart's prepared token cache, in stalwart's sample order), the same micro-batches,
accumulation, AdamW, warm-up and cosine schedule and clipping, and the same first adapters,
so the two runs' losses can be compared step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 (before the world, which it would otherwise outlive)
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from bench.common import add_config_args, append_jsonl, parser


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, __spec__)
    add_config_args(p)
    p.add_argument("--exclude", type=int, default=10,
                   help="warm-up steps left out of the measured window")
    p.add_argument("--out", required=True, help="JSON-lines file that rank 0 appends to")
    return p.parse_args()


def status_bytes(field: str) -> int:
    """A byte count of /proc/self/status: VmRSS (resident now), VmHWM (the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux clear_refs 5), so the next peak is the load's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def packed_rows(args: dict[str, Any], cache_dir: str) -> Any:
    """The train split of stalwart's token cache for these task args (built if missing)."""
    from stalwart.data.token_cache import PackedRows, prepare

    model = str(Path(args["model"]).expanduser().resolve())
    data_dir = prepare(data=args["data"], val_data=args.get("val_data") or None,
                       val_fraction=args.get("val_fraction", 0.05), tokenizer_dir=model,
                       seq_len=args["seq_len"], mode="pack", cache_dir=cache_dir)
    return PackedRows(data_dir / "train")


def lora_model(args: dict[str, Any], seed: int) -> torch.nn.Module:
    """from_pretrained, then peft's adapters; their first values drawn as stalwart draws
    them (each in name order from the seeded RNG: A Kaiming-uniform, B zeros)."""
    table = args["lora"]
    model = AutoModelForCausalLM.from_pretrained(args["model"], attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=table.get("r", 8), lora_alpha=table.get("alpha", 16),
        lora_dropout=table.get("dropout", 0.0), bias="none", task_type="CAUSAL_LM",
        target_modules=table.get("target_modules", "all-linear")))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            elif ".lora_B." in name:
                param.zero_()
    return model


def schedule(steps: int, warmup: int, min_ratio: float) -> Any:
    """Linear warm-up, then cosine decay to min_ratio at the last step."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Load, then train every step; the figures of the run (no tensors, no model)."""
    from stalwart.core.config import load_config
    from stalwart.workers.sampler import GlobalSampler, rank_slice

    config = load_config(args.config, [*args.overrides, f"scaling.num_workers={world}"])
    t, task_args = config.train, config.task.args
    accum = t.global_batch_size // (t.micro_batch_size * world)
    rows = packed_rows(task_args, config.data.cache_dir)

    reset_peak()
    before, start = status_bytes("VmRSS"), time.perf_counter()
    model = lora_model(task_args, t.seed)
    ddp = DistributedDataParallel(model)
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=(0.9, 0.95),
                                  weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, schedule(t.steps, t.warmup_steps, t.min_lr_ratio))
    load_s, load_growth = time.perf_counter() - start, status_bytes("VmHWM") - before
    sampler = GlobalSampler(len(rows), seed=t.seed)

    losses: list[float] = []
    tokens = 0
    dist.barrier()
    ends = [time.time()]  # wall time at the end of each step (index 0: before step 1)
    for step in range(t.steps):
        first, count = rank_slice(step * t.global_batch_size, t.global_batch_size, rank, world)
        items = sampler.items(first, count)
        ddp.train()
        loss_sum, tokens = torch.zeros(()), 0
        for i in range(accum):
            batch = rows.get_batch(items[i * t.micro_batch_size:(i + 1) * t.micro_batch_size])
            tokens += batch["labels"].numel()
            # The gradients are all-reduced once, in the last micro-batch's backward.
            with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
                loss = ddp(**batch).loss / accum
                loss.backward()
            loss_sum += loss.detach()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # the global mean loss, for logging
        losses.append(loss_sum.item() / world)
        ends.append(time.time())
    growths = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(growths, torch.tensor(float(load_growth), dtype=torch.float64))
    measured = t.steps - args.exclude
    window = ends[-1] - ends[args.exclude]
    return {"runner": "peft-ddp", "world_size": world, "steps": t.steps,
            "excluded_steps": args.exclude, "tokens_per_step": tokens * world,
            "window_s": window, "tokens_per_s": measured * tokens * world / window,
            "load_s": load_s, "rss_growth_at_load": [int(g) for g in growths],
            "loss_by_step": {str(i + 1): v for i, v in enumerate(losses)},
            "grad_accum": accum, "trainable_params": sum(p.numel() for p in trainable),
            "rows": len(rows), "rows_dir": str(rows.path), "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    row = train(args, rank, world)
    # The DDP model holds the world's group, in reference cycles: it goes first, while every
    # rank is still in the world. A group left to the interpreter's exit, after its peer had
    # gone, kept a rank waiting in its destructor forever.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        append_jsonl(Path(args.out), row)
        print(f"peft DDP: {row['tokens_per_s']:,.0f} tokens/s over steps {args.exclude + 1}.."
              f"{row['steps']}, final loss {row['loss_by_step'][str(row['steps'])]:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
