"""One rank's numerical checks on real tensors: the fingerprint and its trip through the
step's all-reduce (simulated by summing the ranks' slots), the not-finite flag, the guard's
verdicts and decisions, the escalation, and the nan, spike and bitflip faults."""

from __future__ import annotations

import math

import pytest
import torch

from stalwart.core.config import FaultKind, FaultSpec, JobConfig, NumericsConfig
from stalwart.core.numerics import Action, Decision, Fault, Finding, NumericsState
from stalwart.workers.faults import (
    MANTISSA_TOP_BIT,
    SPIKE_FACTOR,
    FaultInjector,
    flip_bit,
)
from stalwart.workers.numerics import (
    FLAGS,
    INT_OF_SIZE,
    SLOT_BITS,
    NumericsEscalation,
    NumericsGuard,
    fingerprint,
    fingerprint_slots,
    not_finite,
    read_fingerprints,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CPU = torch.device("cpu")
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
UNSIGNED = (1 << 64) - 1  # the slots carry every bit, read back unsigned


def flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of `t` with one bit of element `index` flipped."""
    out = t.clone()
    ints = out.view(-1).view(INT_OF_SIZE[out.element_size()])
    mask = torch.ones((), dtype=ints.dtype).bitwise_left_shift(bit)  # bit 63 wraps to the sign
    ints[index] ^= mask
    return out


def as_unsigned(t: torch.Tensor) -> list[int]:
    bits = 8 * t.element_size()
    return [v % (1 << bits) for v in t.view(-1).view(INT_OF_SIZE[t.element_size()]).tolist()]


def differing_bits(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    count = 0
    for a, b in zip(before, after, strict=True):
        count += sum(bin(x ^ y).count("1") for x, y in zip(as_unsigned(a), as_unsigned(b),
                                                            strict=True))
    return count


def fp(*tensors: torch.Tensor) -> int:
    return int(fingerprint(list(tensors), CPU))


def through_all_reduce(fingerprints: list[int]) -> list[int]:
    """Each rank writes its slots; the all-reduce sums them; every rank reads them back."""
    world = len(fingerprints)
    summed = sum(fingerprint_slots(torch.tensor(v, dtype=torch.int64), r, world)
                 for r, v in enumerate(fingerprints))
    assert isinstance(summed, torch.Tensor) and summed.dtype == torch.float32
    return read_fingerprints(summed.tolist())


# ---------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_the_wrapping_int64_sum_of_the_bits() -> None:
    a = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    b = torch.tensor([0.5, 7.0], dtype=torch.float16)
    expected = (sum(a.view(torch.int32).tolist()) + sum(b.view(torch.int16).tolist()))
    value = fingerprint([a, b], CPU)
    assert value.dtype == torch.int64 and value.device == CPU and int(value) == expected


def test_fingerprint_wraps_instead_of_overflowing() -> None:
    # the bits of inf and of a large float64 are near 2^63: their sum passes int64's range
    t = torch.tensor([math.inf, 1e300, 1e300, 1e300], dtype=torch.float64)
    raw = sum(t.view(torch.int64).tolist())
    wrapped = (raw + (1 << 63)) % (1 << 64) - (1 << 63)
    assert raw != wrapped and fp(t) == wrapped


def test_fingerprint_of_nothing_is_zero() -> None:
    assert fp() == 0
    assert fp(torch.empty(0), torch.empty(0, 3, dtype=torch.float16)) == 0


def test_fingerprint_is_the_same_for_equal_state_and_reads_non_contiguous_tensors() -> None:
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    assert fp(t, t.t()) == fp(t.clone(), t.t().contiguous())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_any_single_flipped_bit_changes_the_fingerprint(dtype: torch.dtype) -> None:
    t = torch.randn(5, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = fp(t, torch.ones(3))
    for bit in range(8 * t.element_size()):
        assert fp(flipped(t, 2, bit), torch.ones(3)) != before, f"bit {bit}"


# ---------------------------------------------------------------------------- the slots


def test_slots_hold_three_parts_at_the_ranks_place() -> None:
    assert SLOT_BITS == (24, 24, 16)
    value = torch.tensor((3 << 48) | (5 << 24) | 7, dtype=torch.int64)
    slots = fingerprint_slots(value, rank=1, world_size=3)
    assert slots.dtype == torch.float32 and slots.tolist() == [0, 0, 0, 7, 5, 3, 0, 0, 0]


def test_fingerprints_survive_the_sum_exactly() -> None:
    values = [0, -1, (1 << 63) - 1, -(1 << 63), 0x123456789ABCDEF, -987654321987, 1 << 47]
    assert through_all_reduce(values) == [v & UNSIGNED for v in values]


def test_every_slot_is_exact_in_float32() -> None:
    for v in (-1, (1 << 48) - 1, 0xFFFFFF000000):
        slots = fingerprint_slots(torch.tensor(v, dtype=torch.int64), 0, 1)
        assert all(0 <= s < (1 << 24) and s == int(s) for s in slots.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_any_single_flipped_bit_still_differs_after_the_all_reduce(dtype: torch.dtype) -> None:
    t = torch.randn(5, generator=torch.Generator().manual_seed(2)).to(dtype)
    good = fp(t)
    for bit in range(8 * t.element_size()):
        bad = fp(flipped(t, 0, bit))
        read = through_all_reduce([good, bad, good])
        assert read[0] == read[2] != read[1], f"bit {bit}"


def test_a_bitflip_in_a_float64_model_still_differs_after_the_all_reduce() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    good = fp(*[p.detach() for p in model.parameters()])
    flip_bit(model)
    bad = fp(*[p.detach() for p in model.parameters()])
    assert good != bad  # the fingerprint itself tells them apart
    read = through_all_reduce([good, bad, good])
    assert read[0] == read[2] != read[1]


# ---------------------------------------------------------------------------- not_finite


def test_not_finite_flags_the_loss_or_the_gradients() -> None:
    ok = [torch.ones(3), torch.zeros(2, 2)]
    flag = not_finite(torch.tensor(2.0), ok)
    assert flag.dtype == torch.float32 and float(flag) == 0.0
    assert float(not_finite(torch.tensor(math.nan), ok)) == 1.0
    assert float(not_finite(torch.tensor(-math.inf), [])) == 1.0
    assert float(not_finite(torch.tensor(2.0), [])) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        grads = [torch.ones(3), torch.tensor([[0.0, bad], [1.0, 2.0]])]
        assert float(not_finite(torch.tensor(2.0), grads)) == 1.0, bad


# ---------------------------------------------------------------------------- NumericsGuard


def guard(world: int = 3, classes: list[int] | None = None, **numerics: object) -> NumericsGuard:
    settings = {"spike_z": 6.0, "spike_window": 5, "spike_warmup": 0, "fingerprint_every": 2,
                "evict_after": 2, "max_skips": 1, **numerics}
    config = JobConfig(numerics=NumericsConfig(**settings))  # type: ignore[arg-type]
    return NumericsGuard(config, rank=0, world_size=world,
                         classes=classes if classes is not None else [0] * world)


def agreed(flag: float, fingerprints: list[int] | None = None) -> list[float]:
    """The checks' part of the all-reduced summary: the flags (`flag` ranks whose gradient
    norm is not finite, no loss that is not), then the slots."""
    flags = [0.0, 0.0, flag]
    if fingerprints is None:
        return flags
    world = len(fingerprints)
    summed = sum(fingerprint_slots(torch.tensor(v, dtype=torch.int64), r, world)
                 for r, v in enumerate(fingerprints))
    assert isinstance(summed, torch.Tensor)
    return [*flags, *summed.tolist()]


def test_matching_fingerprints_verify_the_previous_step() -> None:
    g = guard()
    assert g.verdict(4, 1.0, agreed(0.0, [9, 9, 9]), fingerprinted=True) is None
    assert g.verified == 3
    assert g.verdict(5, 1.0, agreed(0.0), fingerprinted=False) is None
    assert g.verified == 3  # no fingerprint, nothing vouched for


def test_an_odd_replica_is_a_mismatch_naming_it() -> None:
    g = guard()
    g.verified = 2
    finding = g.verdict(6, 1.0, agreed(0.0, [9, 9, 8]), fingerprinted=True)
    assert finding is not None and finding.fault is Fault.MISMATCH
    assert finding.step == 6 and finding.ranks == (2,) and finding.attributed
    assert "[2] differ from their replicas" in finding.detail and "after step 5" in finding.detail
    assert g.verified == 2  # not moved by a mismatch


def test_a_split_is_a_mismatch_no_rank_is_blamed_for() -> None:
    g = guard(world=2)
    finding = g.verdict(4, 1.0, agreed(0.0, [1, 2]), fingerprinted=True)
    assert finding is not None and finding.fault is Fault.MISMATCH
    assert finding.ranks == (0, 1) and not finding.attributed
    assert "no majority" in finding.detail


def test_replicas_are_compared_within_their_class_only() -> None:
    g = guard(world=4, classes=[0, 1, 0, 1])
    assert g.verdict(2, 1.0, agreed(0.0, [5, 6, 5, 6]), fingerprinted=True) is None


def test_a_mismatch_comes_before_a_nan_and_a_nan_before_a_spike() -> None:
    g = guard()
    for _ in range(5):
        g.accept(1.0)
    first = g.verdict(4, 1e6, agreed(1.0, [9, 9, 8]), fingerprinted=True)
    assert first is not None and first.fault is Fault.MISMATCH
    second = g.verdict(4, 1e6, agreed(2.0, [9, 9, 9]), fingerprinted=True)
    assert second is not None and second.fault is Fault.NAN and second.ranks == ()
    assert second.detail == "gradient norm not finite on 2 rank(s)"
    third = g.verdict(5, 1e6, agreed(0.0), fingerprinted=False)
    assert third is not None and third.fault is Fault.SPIKE and "robust" in third.detail
    assert g.verdict(5, 1.0, agreed(0.0), fingerprinted=False) is None


def test_no_spike_check_when_it_is_off() -> None:
    g = guard(spike_z=0.0)
    for _ in range(10):
        g.accept(1.0)
    assert g.verdict(11, 1e9, agreed(0.0), fingerprinted=False) is None


def test_decide_replays_then_skips_then_stops_and_records_each_decision() -> None:
    g = guard(max_skips=1)
    nan = Finding(Fault.NAN, 7, (), "not finite")
    assert g.decide(nan, attempt=1, started=0.0).action is Action.REPLAY
    assert g.decide(nan, attempt=2, started=0.0).action is Action.SKIP
    g.skipped(7)
    g.skipped(7)
    assert g.state.skipped == [7] and g.must_skip(7)
    assert g.decide(Finding(Fault.SPIKE, 9), attempt=2, started=0.0).action is Action.STOP
    events = g.drain()
    assert [(e["step"], e["fault"], e["action"]) for e in events] == [
        (7, "nan", "replay"), (7, "nan", "skip"), (9, "spike", "stop")]
    assert set(events[0]) == {"step", "fault", "action", "ranks", "rollback_to", "detail",
                              "reason", "decided_s", "time"}
    assert events[0]["ranks"] == [] and events[0]["detail"] == "not finite"
    assert events[0]["decided_s"] >= 0
    assert g.drain() == []


def test_mismatches_strike_their_ranks_roll_back_then_evict() -> None:
    g = guard()
    g.verdict(4, 1.0, agreed(0.0, [9, 9, 9]), fingerprinted=True)  # verifies step 3
    finding = g.verdict(6, 1.0, agreed(0.0, [9, 9, 8]), fingerprinted=True)
    assert finding is not None
    first = g.decide(finding, attempt=1, started=0.0)
    assert first.action is Action.ROLLBACK and first.rollback_to == 3 and g.strikes == {2: 1}
    second = g.decide(finding, attempt=1, started=0.0)
    assert second.action is Action.EVICT and second.rollback_to == 3 and g.strikes == {2: 2}
    assert [e["action"] for e in g.drain()] == ["rollback", "evict"]


def test_a_split_strikes_nobody() -> None:
    g = guard(world=2, evict_after=1)
    g.verified = 5
    split = Finding(Fault.MISMATCH, 8, (0, 1), "split", attributed=False)
    for _ in range(3):
        assert g.decide(split, attempt=1, started=0.0).action is Action.ROLLBACK
    assert g.strikes == {}


@pytest.mark.parametrize("verified", [None, 0])
def test_a_mismatch_with_no_snapshot_to_restore_stops(verified: int | None) -> None:
    g = guard()
    g.verified = verified  # step 0 (the start) has no snapshot to roll back to
    decision = g.decide(Finding(Fault.MISMATCH, 2, (1,), "d"), attempt=1, started=0.0)
    assert decision.action is Action.STOP


def test_must_skip_the_configured_and_the_skipped_steps() -> None:
    g = guard(skip_steps=[4, 9])
    g.skipped(6)
    assert [s for s in range(1, 12) if g.must_skip(s)] == [4, 6, 9]


def test_the_guard_is_on_when_any_check_is() -> None:
    assert guard().on
    assert guard(spike_z=0.0, fingerprint_every=0).on  # the NaN check alone
    assert not guard(nan_check=False, spike_z=0.0, fingerprint_every=0).on
    assert guard(nan_check=False, spike_z=0.0, fingerprint_every=3).on


def test_fingerprint_steps() -> None:
    assert [s for s in range(1, 10) if guard(fingerprint_every=3).fingerprints_at(s)] == [3, 6, 9]
    assert not any(guard(fingerprint_every=0).fingerprints_at(s) for s in range(1, 10))


def test_checks_carry_the_flag_then_this_ranks_slots_on_fingerprint_steps() -> None:
    g = guard()
    params = [torch.ones(4), torch.full((2,), 0.5)]
    calls: list[int] = []

    def tensors() -> list[torch.Tensor]:
        calls.append(1)
        return params

    plain = g.checks(3, torch.tensor(math.nan), [], tensors, 0)
    # rank 0's loss is NaN: one rank, rank 0 (its number plus one in the second entry)
    assert not plain.fingerprinted and [float(v) for v in plain.values] == [1.0, 1.0, 0.0]
    assert calls == []  # no fingerprint off its steps: its cost is not paid
    with_fp = g.checks(4, torch.tensor(1.0), [torch.ones(2)], tensors, 0)
    assert with_fp.fingerprinted and len(with_fp.values) == FLAGS + len(SLOT_BITS) * 3
    reduced = [float(v) for v in with_fp.values]
    assert reduced[:FLAGS] == [0.0, 0.0, 0.0]
    assert read_fingerprints(reduced[FLAGS:]) == [fp(*params) & UNSIGNED, 0, 0]


def test_checks_flag_nothing_with_the_nan_check_off() -> None:
    g = guard(nan_check=False)
    out = g.checks(3, torch.tensor(math.nan), [], list, 0)
    assert [float(v) for v in out.values] == [0.0] * FLAGS


def test_state_round_trip_restores_the_spike_window_and_the_skips() -> None:
    a = guard(skip_steps=[2])
    for loss in [5.0, 4.0, 3.0, 2.0, 1.9, 1.8, 1.7]:
        a.accept(loss)
    a.skipped(5)
    text = a.snapshot_state()
    b = guard(skip_steps=[2])
    b.load_state(text)
    assert list(b.spikes.losses) == [3.0, 2.0, 1.9, 1.8, 1.7] and b.spikes.accepted == 7
    assert b.state.skipped == [5] and b.must_skip(5)
    assert NumericsState.from_json(b.snapshot_state()) == NumericsState.from_json(text)
    for loss in (1.75, 2.5, 10.0):
        assert b.spikes.score(loss) == a.spikes.score(loss)


def test_loading_an_empty_state_starts_fresh() -> None:
    g = guard()
    for _ in range(6):
        g.accept(1.0)
    g.skipped(3)
    g.load_state("")
    assert list(g.spikes.losses) == [] and g.spikes.accepted == 0 and g.state.skipped == []


def test_a_state_given_unsorted_with_repeats_is_cleaned() -> None:
    config = JobConfig()
    g = NumericsGuard(config, rank=0, world_size=1, classes=[0],
                      state=NumericsState(skipped=[9, 3, 9]))
    assert g.state.skipped == [3, 9]


# ---------------------------------------------------------------------------- escalation


def escalate(action: Action, ranks: tuple[int, ...], why: str | None = None
             ) -> NumericsEscalation:
    finding = Finding(Fault.MISMATCH, 40, ranks, "differ")
    evict = ranks if action is Action.EVICT else ()
    return NumericsEscalation(Decision(action, finding, "because", rollback_to=38,
                                       evict=evict), why)


def test_an_eviction_evicts_the_ranks_found() -> None:
    exc = escalate(Action.EVICT, (1,))
    assert exc.evict == (1,)
    assert str(exc) == ("numerical fault at step 40 (mismatch: differ); replacing rank(s) "
                        "[1]: because")


def test_a_stop_evicts_nobody() -> None:
    exc = escalate(Action.STOP, (1,))
    assert exc.evict == () and "; stopping: because" in str(exc)


def test_an_eviction_that_cannot_be_carried_out_evicts_nobody() -> None:
    exc = escalate(Action.EVICT, (1,), why="no snapshot of step 38 is held")
    assert exc.evict == () and str(exc).endswith("stopping: no snapshot of step 38 is held")
    rollback = escalate(Action.ROLLBACK, (1,), why="no snapshot")
    assert rollback.evict == ()


def test_an_eviction_replaces_only_the_ranks_that_reached_evict_after() -> None:
    g = guard(world=5)
    g.strikes = {3: 1}  # rank 3 differed once before; rank 4 never
    g.verified = 38
    finding = Finding(Fault.MISMATCH, 40, (3, 4), "differ")
    decision = g.decide(finding, attempt=1, started=0.0)
    assert decision.action is Action.EVICT and g.strikes == {3: 2, 4: 1}
    assert decision.reason.startswith("rank(s) [3] differed")
    assert NumericsEscalation(decision).evict == (3,)


# ---------------------------------------------------------------------------- the faults


def armed(kind: str, step: int, rank: int = 1) -> FaultInjector:
    """An injector holding one fault; a short notice timeout: no controller acknowledges."""
    injector = FaultInjector(notice_timeout_s=0.01)
    injector.arm(rank, [FaultSpec(kind=kind, step=step, rank=rank)])
    return injector


def test_a_nan_fault_makes_the_loss_nan_once_at_its_step() -> None:
    injector = armed("nan", 20)
    injector.at_step(19)
    assert injector.loss_factor(19) == 1.0 and injector.loss_factor(20) == 1.0  # not fired
    injector.at_step(20)
    assert [(f.fault.kind, f.rank, f.step) for f in injector.drain()] == [
        (FaultKind.NAN, 1, 20)]
    assert injector.loss_factor(21) == 1.0
    assert math.isnan(injector.loss_factor(20))
    assert injector.loss_factor(20) == 1.0  # the replay trains on a finite loss


def test_a_spike_fault_scales_every_try_of_its_step() -> None:
    injector = armed("spike", 30)
    injector.at_step(30)
    assert [injector.loss_factor(30) for _ in range(3)] == [SPIKE_FACTOR] * 3
    assert injector.loss_factor(31) == 1.0


def test_disarm_drops_the_faults_due() -> None:
    injector = armed("spike", 30)
    injector.at_step(30)
    injector.disarm()
    assert injector.loss_factor(30) == 1.0


def bits_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_bitflip_fault_flips_exactly_one_bit_once_at_its_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    injector = armed("bitflip", 40)
    before = bits_of(model)
    injector.tamper(40, model)  # not fired yet
    injector.at_step(40)
    injector.tamper(39, model)
    assert differing_bits(before, bits_of(model)) == 0
    injector.tamper(40, model)
    after = bits_of(model)
    assert differing_bits(before, after) == 1
    assert as_unsigned(after[0])[0] ^ as_unsigned(before[0])[0] == 1 << 22
    injector.tamper(40, model)  # done once, not on the replay
    assert differing_bits(after, bits_of(model)) == 0


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_flip_bit_flips_the_top_mantissa_bit_of_the_first_element(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    before = bits_of(model)
    where = flip_bit(model)
    after = bits_of(model)
    size = before[0].element_size()
    assert where == f"weight[0] bit {MANTISSA_TOP_BIT[size]}"
    assert differing_bits(before, after) == 1
    assert as_unsigned(after[0])[0] ^ as_unsigned(before[0])[0] == 1 << MANTISSA_TOP_BIT[size]
    assert torch.isfinite(after[0]).all()


def test_flip_bit_passes_over_empty_and_integer_parameters() -> None:
    model = torch.nn.Module()
    model.empty = torch.nn.Parameter(torch.empty(0))
    model.counts = torch.nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False)
    model.inner = torch.nn.Linear(2, 2)
    before = bits_of(model)
    assert flip_bit(model) == "inner.weight[0] bit 22"
    assert differing_bits(before, bits_of(model)) == 1


def test_flip_bit_needs_a_floating_parameter() -> None:
    model = torch.nn.Module()
    model.counts = torch.nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False)
    with pytest.raises(RuntimeError, match="no floating parameter"):
        flip_bit(model)


def test_the_fingerprint_views_follow_in_place_updates_until_the_state_is_replaced() -> None:
    g = guard(world=1)
    params = [torch.ones(4), torch.full((2,), 0.5)]
    first = g.checks(4, torch.tensor(1.0), [], lambda: params, 0)
    params[0].add_(1.0)  # an optimizer step: in place, the same version
    second = g.checks(8, torch.tensor(1.0), [], lambda: params, 0)
    assert second.values[FLAGS:] != first.values[FLAGS:]
    assert read_fingerprints([float(v) for v in second.values[FLAGS:]]) == \
        [fp(*params) & UNSIGNED]
    replaced = [torch.zeros(4), params[1]]  # a load replaced a tensor: a new version
    third = g.checks(12, torch.tensor(1.0), [], lambda: replaced, 1)
    assert read_fingerprints([float(v) for v in third.values[FLAGS:]]) == \
        [fp(*replaced) & UNSIGNED]


def test_the_flags_name_the_one_rank_whose_loss_is_not_finite() -> None:
    from stalwart.workers.numerics import finite_flags, not_finite_detail

    world = [finite_flags(torch.tensor(math.nan if r == 2 else 1.0),
                          [torch.tensor([math.nan])], r) for r in range(4)]
    summed = [float(sum(f[i] for f in world)) for i in range(FLAGS)]
    assert summed == [1.0, 3.0, 4.0]
    assert not_finite_detail(summed) == ("loss not finite on rank 2; gradient norm not finite "
                                         "on 4 rank(s)")
    assert not_finite_detail([3.0, 9.0, 0.0]) == "loss not finite on 3 ranks"
