"""Fine-tune: a LoRA fine-tune of a small pretrained Llama on 2 DDP workers through `stalwart
run`, against a hand-written transformers + peft + DDP loop under torchrun; tokens/s.

Both read one TOML: the model made by tests/pretrained.py, its chat rows packed once into
stalwart's token cache, the same rows in the same order, micro-batch, accumulation, AdamW,
schedule and first adapters (LoRA on q_proj and v_proj). stalwart's rate is taken from its
run's metrics.jsonl, the baseline's from its own step clock, both over the steps after the
first --exclude; the runners alternate over --rounds.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import fmt, ratio

GOAL = 0.95
WORKERS = 2
RUNNERS = ("stalwart", "peft-ddp")
CONFIG = """\
[task]
path = "stalwart.tasks.hf:CausalLM"

[task.args]
model = "{model}"
data = "{data}"
seq_len = {seq_len}
lora = {{ r = {rank}, alpha = {alpha}, target_modules = ["q_proj", "v_proj"] }}

[scaling]
num_workers = {workers}
spare_workers = 0

[parallel]
dp_replicate = {workers}
dp_shard = 1

[train]
steps = {steps}
global_batch_size = {global_batch}
micro_batch_size = {micro_batch}
lr = 1e-3
warmup_steps = 5

[checkpoint]
persist_every = {persist}

[data]
val_every = 0
cache_dir = "{cache}"

[run]
progress = false
log_every = {log_every}
"""


def make_job(work: Path, args: Any) -> tuple[Path, int, str]:
    """The model, the data and the TOML; the data tokenized before any timed run.
    (config path, tokens per step, the prepared cache directory)."""
    from stalwart.core.config import load_config
    from stalwart.core.task import build_task
    from tests.pretrained import make_chat_data, make_model_dir

    model = make_model_dir(work / "model", layers=args.layers, hidden=args.hidden)
    data = make_chat_data(work / "chat.jsonl", args.rows)
    path = work / "finetune.toml"
    path.write_text(CONFIG.format(
        model=model, data=data, seq_len=args.seq_len, rank=args.lora_r, alpha=2 * args.lora_r,
        workers=WORKERS, steps=args.steps, global_batch=args.global_batch,
        micro_batch=args.micro_batch, persist=args.steps + 1, cache=work / "cache",
        log_every=args.log_every))
    config = load_config(path)
    task = build_task(config.task.path, config.task.args)
    task.prepare_data(config)
    prepared = str(task.train_dataset(config).path.parent)
    return path, config.train.global_batch_size * args.seq_len, prepared


def one_run(runner: str, rnd: int, *, args: Any, work: Path, config: Path, tps: int,
            prepared: str) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
    result: dict[str, Any] = {"runner": runner, "round": rnd}
    if runner == "stalwart":
        run_dir = work / tag
        result["run_dir"] = str(run_dir)
        cmd = common.stalwart_command(str(config), args.overrides, run_dir)
        return common.rate_run(tag, cmd, args, work, result, lambda: common.stalwart_rate(
            run_dir, args.exclude, tps, cross_check=True))
    out = work / f"{tag}.json"

    def measure() -> dict[str, Any]:
        row = json.loads(out.read_text().splitlines()[-1])
        got = {k: row[k] for k in ("tokens_per_s", "window_s", "loss_by_step", "load_s",
                                   "rss_growth_at_load", "trainable_params")}
        got["measured_steps"] = row["steps"] - row["excluded_steps"]
        warnings = []
        if row["tokens_per_step"] != tps:
            warnings.append(f"tokens/step {row['tokens_per_step']} != {tps}")
        if Path(row["rows_dir"]).parent != Path(prepared):
            warnings.append(f"it read {row['rows_dir']}, not stalwart's {prepared}")
        if warnings:
            got["warning"] = "; ".join(warnings)
        return got

    cmd = common.torchrun("bench.peers.finetune_peft", WORKERS, [
        "--config", str(config), "--exclude", str(args.exclude), "--out", str(out)])
    return common.rate_run(tag, cmd, args, work, result, measure)


def print_table(rates: dict[tuple[str, int], float], medians: dict[str, float | None],
                rounds: int) -> float | None:
    head = f"{'round':>6} | {'stalwart':>9} | {'peft DDP':>9} | {'ratio':>6}"
    print("\ntokens/s (steady state)\n" + head + "\n" + "-" * len(head))

    def line(label: str, s: float | None, b: float | None) -> str:
        return f"{label:>6} | {fmt(s)} | {fmt(b)} | {fmt(ratio(s, b), '6.3f')}"

    for rnd in range(rounds):
        print(line(str(rnd + 1), rates.get(("stalwart", rnd)), rates.get(("peft-ddp", rnd))))
    print("-" * len(head) + "\n" + line("median", medians["stalwart"], medians["peft-ddp"]))
    return ratio(medians["stalwart"], medians["peft-ddp"])


def main() -> int:
    p = common.parser(__doc__, __spec__, "finetune.json")
    p.add_argument("--hidden", type=common.positive(), default=256,
                   help="hidden size of the Llama made (default 256)")
    p.add_argument("--layers", type=common.positive(), default=4, help="its layers (default 4)")
    p.add_argument("--rows", type=common.positive(), default=2000,
                   help="chat rows in the data (default 2000)")
    p.add_argument("--seq-len", type=common.positive(), default=128,
                   help="packed row length (default 128; the model allows 256)")
    p.add_argument("--global-batch", type=common.positive(), default=8,
                   help="rows per step over both workers (default 8)")
    p.add_argument("--micro-batch", type=common.positive(), default=2,
                   help="rows per forward (default 2: 2 accumulation steps a worker)")
    p.add_argument("--lora-r", type=common.positive(), default=8,
                   help="LoRA rank, alpha twice it (default 8)")
    p.add_argument("--steps", type=common.positive(), default=40,
                   help="optimizer steps per run (default 40)")
    p.add_argument("--exclude", type=common.positive(), default=10,
                   help="warm-up steps left out (default 10; a multiple of --log-every)")
    p.add_argument("--log-every", type=common.positive(), default=5,
                   help="stalwart's run.log_every (default 5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of stalwart's runs only, to find what costs "
                        "(e.g. checkpoint.snapshot_every=0; repeatable)")
    common.add_run_args(p, 300.0, rounds=3)
    args = p.parse_args()
    if args.exclude % args.log_every or args.steps <= args.exclude:
        p.error("--exclude must be a multiple of --log-every and below --steps")
    if args.global_batch % (args.micro_batch * WORKERS):
        p.error(f"--global-batch must be a multiple of --micro-batch x {WORKERS} workers")
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-finetune-"))
    config, tps, prepared = make_job(work, args)
    config_text = config.read_text()
    print(f"finetune: {args.rounds} round(s) x {list(RUNNERS)}, {args.steps} steps each (first "
          f"{args.exclude} excluded), {tps} tokens/step (global batch {args.global_batch}, "
          f"micro-batch {args.micro_batch}, seq_len {args.seq_len}), Llama hidden "
          f"{args.hidden} x {args.layers} layers, LoRA r={args.lora_r} on q_proj, v_proj; "
          f"{WORKERS} workers DDP; work in {work}", flush=True)
    results = common.run_rounds(
        list(RUNNERS), args.rounds,
        lambda name, rnd: one_run(name, rnd, args=args, work=work, config=config, tps=tps,
                                  prepared=prepared),
        work=work, keep=args.keep, prune_measured=False)
    medians = common.medians(results, "runner", list(RUNNERS))
    rates = common.by_round(results, "runner")
    got = print_table(rates, medians, args.rounds)
    losses = common.worst_loss_diff(
        (a, b) for a in results for b in results
        if a["runner"] == "stalwart" and b["runner"] == "peft-ddp" and a["round"] == b["round"]
        and "loss_by_step" in a and "loss_by_step" in b)
    print(f"\nloss vs the baseline at stalwart's logged steps, max |diff|: {fmt(losses, '.2e')}")
    base = [r for r in results if r["runner"] == "peft-ddp" and "rss_growth_at_load" in r]
    if base:
        print("baseline per rank at load: " + ", ".join(
            f"{g / 2**20:.1f} MiB" for g in base[-1]["rss_growth_at_load"])
            + f" peak RSS growth, {base[-1]['load_s']:.2f} s (stalwart's: python -m bench.load)")
    met = got is not None and got >= GOAL
    if got is None:
        print("\nno comparison: a runner produced no measurement (see the logs above)")
    else:
        print(f"\nstalwart / peft DDP = {got:.3f}; goal >= {GOAL}: {'MET' if met else 'NOT MET'}")
    common.write_report(args.out, {
        "bench": "finetune", "time": time.time(), "goal": GOAL, "goal_met": met,
        "ratio_stalwart_over_peft_ddp": got, "median_tokens_per_s": medians,
        "paired_ratios": common.paired(rates, "stalwart", "peft-ddp", args.rounds),
        "loss_max_abs_diff": losses,
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {
            "workers": WORKERS, "tokens_per_step": tps, "config": config_text}},
        results)
    return 0 if got is not None else 1


if __name__ == "__main__":
    sys.exit(main())
