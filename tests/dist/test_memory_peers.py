"""Snapshots from a lying peer, on real gloo ranks: a header for a step from the future, a
snapshot that says it is another rank's shard, and a layout that claims another rank's
chunks are each refused by their holder (SnapshotRefused, nothing stored), while the honest
snapshot that holder already kept still restores, bit for bit. A peer that announces claims
of 2**62 bytes when the world forms is refused by every rank before any allocates them. And
ranks of a new world that restored different steps stop before training on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stalwart.checkpointing.errors import SnapshotRefused
from stalwart.checkpointing.memory.tier import MemoryTier
from stalwart.checkpointing.memory.wire import MAX_CLAIMS_BYTES, SnapshotMessage, encode_message
from stalwart.workers.errors import RestoredStepMismatch
from tests.dist.launcher import run_ranks
from tests.dist.test_checkpoint_reshard import make_engine
from tests.dist.test_data_parallel import cache_dir  # noqa: F401 (fixture)
from tests.dist.toy_state import Toy

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

FORGER = 2  # one rank per pretend node: rank r's replica is on rank r+1, so rank 0 holds 2's


def _round(tier: MemoryTier, toy: Toy, step: int, refusals: list[str]) -> None:
    for t in toy.tensors.values():
        t.add_(1)  # the state moves every step
    toy.step = step
    tier.snapshot(step)
    try:
        tier.wait_replicated()
    except SnapshotRefused as exc:
        refusals.append(str(exc))
    tier.replicator.barrier()  # every exchange of the round is complete


def lying_peer(rank: int, world: int) -> dict:
    toy, tier, refusals = Toy(rank), MemoryTier(), []
    tier.join(toy.view(), rank=rank, generation=0, nodes=["n0", "n1", "n2"], replicas=1,
              limit_gb=1.0)
    _round(tier, toy, 1, refusals)  # honest
    honest = {k: v.clone() for k, v in toy.tensors.items()}
    # Round 2: the forger's snapshot says it is step 99 (a step from the future).
    _round(tier, toy, 99 if rank == FORGER else 2, refusals)
    # Round 3: the forger sends its shard as rank 1's.
    if rank == FORGER:
        replicator = tier.replicator

        def as_rank_1(shard, with_layout):  # noqa: ANN001, ANN202
            return encode_message(SnapshotMessage(
                generation=0, source=1, step=shard.step, nbytes=shard.layout.nbytes,
                crc=shard.crc, layout_key=shard.layout.key,
                layout=shard.layout if with_layout else None, values=shard.values))
        replicator._message = as_rank_1  # type: ignore[method-assign]
    _round(tier, toy, 3, refusals)
    # Round 4: the forger's layout claims rank 1's tensor besides its own.
    if rank == FORGER:
        del tier.replicator._message
        toy.tensors["w1"] = torch.zeros(4)
    _round(tier, toy, 4, refusals)
    inventory = tier.inventory()
    out = {"refusals": refusals, "honest": honest, "inventory": inventory}
    if rank == 0:
        # What rank 0 holds for the forger is its honest step 1, and it restores exactly.
        held = [h for h in inventory.holdings if h.source == FORGER]
        out["held"] = [(h.source, h.step) for h in held]
        layouts = {FORGER: inventory.layouts[held[0].layout_key]}
        target = Toy(FORGER)
        target.tensors = {f"w{FORGER}": torch.zeros(4)}
        tier.restore(target.view(), generation=0, step=1, layouts=layouts,
                     fetch=lambda src: pytest.fail("nothing is fetched"))
        out["restored"] = (target.tensors, target.step)
    tier.leave()
    return out


def test_a_lying_peer_is_refused_and_the_honest_snapshot_still_restores() -> None:
    results = run_ranks(lying_peer, 3)
    refusals = results[0]["refusals"]
    assert len(refusals) == 3, refusals
    assert "refused rank 2's snapshot: it is for step 99 (header 99), but step 2 is being " \
           "exchanged" in refusals[0]
    assert "refused rank 2's snapshot: it says it is rank 1's shard" in refusals[1]
    assert "refused rank 2's snapshot: its layout claims chunks of other ranks: " \
           "model.w1[0]" in refusals[2]
    assert results[1]["refusals"] == []  # it holds for an honest rank
    # (The forger, at "step 99", refused rank 1's honest step 2 in turn: its own lie.)
    assert results[0]["held"] == [(FORGER, 1)]  # nothing refused entered the store
    tensors, step = results[0]["restored"]
    assert step == 1
    assert torch.equal(tensors[f"w{FORGER}"], results[FORGER]["honest"][f"w{FORGER}"])
    # Rank 0's inventory never lists a layout claiming w1 for the forger.
    for h in results[0]["inventory"].holdings:
        if h.source == FORGER:
            names = {it.index.fqn for it in results[0]["inventory"].layouts[h.layout_key].items}
            assert "model.w1" not in names


def huge_claims(rank: int, world: int) -> list[str]:
    toy, tier, refusals = Toy(rank), MemoryTier(), []
    tier.join(toy.view(), rank=rank, generation=0, nodes=["n0", "n1", "n2"], replicas=1,
              limit_gb=1.0)
    if rank == FORGER:
        group = tier.replicator.group

        def announce_huge(layout) -> None:  # noqa: ANN001
            # The lengths' all-gather as every rank runs it, with a length no one could hold.
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(lengths, torch.tensor([1 << 62], dtype=torch.int64), group=group)
            raise SnapshotRefused("the forger stops here, as the others do")
        tier.replicator._share_claims = announce_huge  # type: ignore[method-assign]
    _round(tier, toy, 1, refusals)
    tier.leave()
    return refusals


def test_claims_of_a_size_no_shard_has_are_refused_by_every_rank() -> None:
    honest = run_ranks(huge_claims, 3)[:FORGER]
    # Allocating world * 2**62 bytes would have failed with torch's own error, not this one.
    for refusals in honest:
        assert refusals == [f"rank {FORGER} announces its shard's claims of {1 << 62} bytes; "
                            f"from 0 to {MAX_CLAIMS_BYTES} are accepted"]


def restored_steps(rank: int, world: int, cache: str, cases: list[list[int]]) -> list[str]:
    """For each case, this rank's engine as if it had restored `case[rank]`; what the check
    says (the check is a collective: every rank runs the cases in the same order)."""
    engine = make_engine(rank, world, cache, [])
    said = []
    for steps in cases:
        engine.step = steps[rank]
        try:
            engine.check_restored_step()
        except RestoredStepMismatch as exc:
            said.append(str(exc))
        else:
            said.append("same")
    return said


def test_ranks_that_restored_different_steps_do_not_train_on(cache_dir) -> None:  # noqa: F811
    same, different = zip(*run_ranks(restored_steps, 2, cache_dir, [[4, 4], [4, 5]]),
                          strict=True)
    assert same == ("same", "same")
    assert different[0] == ("the ranks of this world restored different steps (from 4 to 5; "
                            "rank 0 has 4): it must not train on")
    assert different[1].startswith(
        "the ranks of this world restored different steps (from 4 to 5")
