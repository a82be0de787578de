"""The numerical checks on real gloo ranks: a flipped bit is found on the right rank by the
replicas' fingerprints, a NaN is replayed to the failure-free weights bit for bit, and a
spike's batch is skipped to the weights of a run told to skip it."""

from __future__ import annotations

import math

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.numerics import Action, Fault
from stalwart.core.task import build_task
from stalwart.workers.engine import TrainEngine
from stalwart.workers.faults import SPIKE_FACTOR, flip_bit
from stalwart.workers.numerics import NumericsRollback
from tests.dist.launcher import run_ranks
from tests.dist.test_data_parallel import cache_dir, final_weights  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 8


class Hooks:
    """The engine's step hooks, as the fault injector would answer them."""

    def __init__(self, rank: int, *, nan_at: tuple[int, int] | None = None,
                 spike_at: int | None = None) -> None:
        self.rank, self.nan_at, self.spike_at = rank, nan_at, spike_at

    def loss_factor(self, step: int) -> float:
        if self.nan_at == (self.rank, step):
            self.nan_at = None  # once
            return math.nan
        return SPIKE_FACTOR if self.rank == 0 and step == self.spike_at else 1.0

    def tamper(self, step: int, model: torch.nn.Module) -> None:
        pass


def engine_for(rank: int, world: int, cache_dir: str, extra: list[str]) -> TrainEngine:  # noqa: F811
    config = load_config(None, [
        f"scaling.num_workers={world}", "task.args.seq_len=32", "task.args.d_model=32",
        "task.args.n_layers=2", "task.args.n_heads=2", "train.global_batch_size=12",
        "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.lr=1e-2", f'data.cache_dir="{cache_dir}"', f"parallel.dp_replicate={world}",
        "parallel.dp_shard=1", "parallel.invariant_reduction=true", *extra])
    task = build_task(config.task.path, config.task.args)
    return TrainEngine(config, task, rank=rank, world_size=world, device=torch.device("cpu"))


def flipped_on_rank_one(rank: int, world: int, cache_dir: str) -> dict:  # noqa: F811
    engine = engine_for(rank, world, cache_dir, ["numerics.fingerprint_every=1"])
    for _ in range(3):
        engine.train_step()
    if rank == 1:
        flip_bit(engine.model)
    try:
        engine.train_step()
    except NumericsRollback as rollback:
        d = rollback.decision
        return {"action": d.action, "fault": d.finding.fault, "ranks": d.finding.ranks,
                "to": d.rollback_to, "step": engine.step}
    return {}


def test_a_flipped_bit_is_found_on_its_rank_and_rolled_back_before_the_update(cache_dir):  # noqa: F811
    results = run_ranks(flipped_on_rank_one, 3, cache_dir)
    for r in results:  # every rank reaches the same decision, before step 4's update
        assert r == {"action": Action.ROLLBACK, "fault": Fault.MISMATCH, "ranks": (1,),
                     "to": 2, "step": 3}


def weights_after(rank: int, world: int, cache_dir: str, extra: list[str],  # noqa: F811
                  nan_at: tuple[int, int] | None, spike_at: int | None) -> dict:
    engine = engine_for(rank, world, cache_dir, extra)
    hooks = Hooks(rank, nan_at=nan_at, spike_at=spike_at)
    reports = [engine.train_step(hooks=hooks)[0] for _ in range(STEPS)]
    return {"weights": final_weights(engine), "decisions": engine.numerics.drain(),
            "skipped": [r.step for r in reports if r.skipped],
            "replays": [r.replays for r in reports]}


def test_a_nan_is_replayed_to_the_failure_free_weights_bit_for_bit(cache_dir):  # noqa: F811
    clean = run_ranks(weights_after, 2, cache_dir, [], None, None)[0]
    faulty = run_ranks(weights_after, 2, cache_dir, [], (1, 5), None)
    for r in faulty:
        assert [(d["fault"], d["action"], d["step"]) for d in r["decisions"]] == \
            [("nan", "replay", 5)]
        assert r["replays"][4] == 1 and r["skipped"] == []
        for name, value in clean["weights"].items():
            assert torch.equal(r["weights"][name], value), name


def test_a_spike_is_replayed_then_skipped_like_a_run_told_to_skip_its_batch(cache_dir):  # noqa: F811
    spike = ["numerics.spike_z=6", "numerics.spike_warmup=5"]
    told = run_ranks(weights_after, 2, cache_dir, [*spike, "numerics.skip_steps=[7]"],
                     None, None)[0]
    faulty = run_ranks(weights_after, 2, cache_dir, spike, None, 7)
    assert told["skipped"] == [7] and told["decisions"] == []
    for r in faulty:
        assert [(d["fault"], d["action"]) for d in r["decisions"]] == \
            [("spike", "replay"), ("spike", "skip")]
        assert r["skipped"] == [7]
        for name, value in told["weights"].items():
            assert torch.equal(r["weights"][name], value), name


def flipped_in_hsdp(rank: int, world: int, cache_dir: str) -> dict:  # noqa: F811
    config = load_config(None, [
        f"scaling.num_workers={world}", "task.args.seq_len=32", "task.args.d_model=32",
        "task.args.n_layers=2", "task.args.n_heads=2", "train.global_batch_size=8",
        "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.lr=1e-2", f'data.cache_dir="{cache_dir}"', "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "numerics.fingerprint_every=1"])
    engine = TrainEngine(config, build_task(config.task.path, config.task.args), rank=rank,
                         world_size=world, device=torch.device("cpu"))
    for _ in range(3):
        engine.train_step()
    if rank == 1:
        flip_bit(engine.model)  # rank 1's shard: its twin across the replica groups is 3
    try:
        engine.train_step()
    except NumericsRollback as rollback:
        f = rollback.decision.finding
        return {"ranks": f.ranks, "attributed": f.attributed, "to": rollback.decision.rollback_to}
    return {}


def test_hsdp_replica_groups_compare_shard_by_shard(cache_dir):  # noqa: F811
    # Two replica groups of two shards: only shard 1's twins (ranks 1 and 3) differ, and two
    # replicas have no majority to blame one of them.
    for r in run_ranks(flipped_in_hsdp, 4, cache_dir):
        assert r == {"ranks": (1, 3), "attributed": False, "to": 2}
