"""Fault injection: --inject parsing, [[faults]] in TOML, FaultPlan (the driver's: which rank
carries out each fault in a generation of the world) and FaultInjector (the worker's: when
each fault strikes)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch

from stalwart.core.config import (
    FaultKind,
    FaultSpec,
    JobConfig,
    dump_config,
    load_config,
    parse_fault,
)
from stalwart.core.errors import ConfigError
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator.faults import FaultPlan, number_nodes
from stalwart.workers import faults as fault_module
from stalwart.workers.faults import SLOWDOWN, STRIKES_AT, FaultInjector, InjectedFault
from stalwart.workers.local_timer import LocalTimer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KINDS = ("kill, kill-staging, kill-replicating, hang, raise, term, slow, kill-node, freeze-node, "
         "drain, nan, spike, bitflip, slow-link")
SYNTAX = ("expected KIND:TARGET=N,step=S, e.g. kill:rank=1,step=20 or "
          "kill-node:node=1,step=80 (slow-link also takes mbps=M, e.g. "
          f"slow-link:rank=1,step=5,mbps=50); KIND is one of {KINDS}")


# ---------------------------------------------------------------------------- --inject


@pytest.mark.parametrize(("text", "expected"), [
    ("kill:rank=1,step=20", FaultSpec(kind="kill", rank=1, step=20)),
    ("hang:rank=0,step=40", FaultSpec(kind="hang", rank=0, step=40)),
    ("raise:rank=3,step=1", FaultSpec(kind="raise", rank=3, step=1)),
    ("term:step=7,rank=2", FaultSpec(kind="term", rank=2, step=7)),  # any order
    ("kill-node:node=1,step=80", FaultSpec(kind="kill-node", node=1, step=80)),
    ("drain:node=2,step=5", FaultSpec(kind="drain", node=2, step=5)),
    ("  kill:rank=1, step=20 ", FaultSpec(kind="kill", rank=1, step=20)),  # spaces
    ("kill:rank=01,step=020", FaultSpec(kind="kill", rank=1, step=20)),
    ("slow-link:rank=1,step=5,mbps=50", FaultSpec(kind="slow-link", rank=1, step=5, mbps=50)),
    ("slow-link:mbps=0.5,rank=0,step=2", FaultSpec(kind="slow-link", rank=0, step=2, mbps=0.5)),
    ("slow-link:rank=0,step=2,mbps=.25", FaultSpec(kind="slow-link", rank=0, step=2, mbps=0.25)),
])
def test_parse_fault(text: str, expected: FaultSpec) -> None:
    spec = parse_fault(text)
    assert spec == expected
    assert parse_fault(str(spec)) == spec


def test_a_fault_prints_as_the_user_writes_it() -> None:
    assert str(FaultSpec(kind="kill", rank=1, step=20)) == "kill:rank=1,step=20"
    assert str(FaultSpec(kind="kill-node", node=2, step=8)) == "kill-node:node=2,step=8"
    assert {k.value for k in FaultKind} == {
        "kill", "kill-staging", "kill-replicating", "hang", "raise", "term", "slow",
        "kill-node", "freeze-node", "drain", "nan", "spike", "bitflip", "slow-link"}
    # A bad batch needs no rank: rank 0 trains it.
    assert str(parse_fault("spike:step=30")) == "spike:rank=0,step=30"


def test_a_fault_kind_is_the_enum_and_keeps_its_spelling_everywhere() -> None:
    spec = parse_fault("freeze-node:node=1,step=3")
    assert spec.kind is FaultKind.FREEZE_NODE and spec.kind.target == "node"
    assert FaultSpec(kind="kill", rank=0, step=1).kind is FaultKind.KILL  # TOML gives a str
    assert [k for k in FaultKind if k.target == "node"] == [
        FaultKind.KILL_NODE, FaultKind.FREEZE_NODE, FaultKind.DRAIN]
    assert json.dumps({"kind": spec.kind}) == '{"kind": "freeze-node"}'
    assert f"{spec.kind}" == str(spec.kind) == "freeze-node"
    assert pickle.loads(pickle.dumps(spec)) == spec  # as it travels to the workers


@pytest.mark.parametrize("text", [
    "", "kill", "kill:", "kill:rank=1", "kill:rank=1,step=", "kill:rank=1,step=2.5",
    "kill:rank=-1,step=2", "kill:rank=x,step=2", "kill:rank1,step=2",
    "kill:rank=1,rank=2,step=3", "kill:rank=1,step=2,step=3", "kill:pid=1,step=2",
    "kill:kind=hang,step=2", "kill:rank=1;step=2",
    "slow-link:rank=1,step=2,mbps=", "slow-link:rank=1,step=2,mbps=1e3",
    "slow-link:rank=1,step=2,mbps=-5", "slow-link:rank=1,step=2,mbps=.",
    "slow-link:rank=1,step=2,mbps=5,mbps=6", "kill:rank=1,step=2,mbps=x",
])
def test_bad_inject_syntax(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fault(text)
    assert str(err.value) == f"--inject {text!r} is invalid: {SYNTAX}"


@pytest.mark.parametrize(("text", "expected"), [
    ("boom:rank=1,step=2", f"faults.kind = 'boom' is invalid: one of {KINDS}"),
    (":rank=1,step=2", f"faults.kind = '' is invalid: one of {KINDS}"),
    ("kill:node=1,step=2", "faults.node = 1 is invalid: a kill fault targets a rank, not a node"),
    ("kill:step=2", "faults.rank = -1 is invalid: a kill fault needs rank=N with N >= 0"),
    ("drain:rank=1,step=2",
     "faults.rank = 1 is invalid: a drain fault targets a node, not a rank"),
    ("kill-node:step=2", "faults.node = -1 is invalid: a kill-node fault needs node=N with "
                         "N >= 1 (node 0 is the driver's node)"),
    ("kill-node:node=0,step=2", "faults.node = 0 is invalid: a kill-node fault needs node=N "
                                "with N >= 1 (node 0 is the driver's node)"),
    ("kill:rank=1,step=0", "faults.step = 0 is invalid: must be >= 1"),
    ("slow-link:rank=1,step=2", "faults.mbps = 0.0 is invalid: a slow-link fault needs mbps=M "
                                "with M > 0 (megabits per second)"),
    ("slow-link:rank=1,step=2,mbps=0", "faults.mbps = 0.0 is invalid: a slow-link fault "
                                       "needs mbps=M with M > 0 (megabits per second)"),
    ("kill:rank=1,step=2,mbps=5", "faults.mbps = 5.0 is invalid: only a slow-link fault "
                                  "takes mbps, not a kill fault"),
    ("slow-link:node=1,step=2,mbps=5",
     "faults.node = 1 is invalid: a slow-link fault targets a rank, not a node"),
])
def test_bad_fault_names_the_field(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fault(text)
    assert str(err.value) == f"--inject {text!r}: {expected}"


def test_a_digit_int_cannot_read_is_bad_syntax() -> None:
    with pytest.raises(ConfigError, match="is invalid: expected KIND:TARGET=N,step=S"):
        parse_fault("kill:rank=\u00b2,step=2")


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"kind": "kill", "step": 1, "rank": 0}, None),
    ({"kind": "drain", "step": 1, "node": 1}, None),
    ({"kind": "hang", "step": -3, "rank": 0}, "faults.step = -3 is invalid: must be >= 1"),
    ({"kind": "term", "step": 1, "rank": 0, "node": 1},
     "faults.node = 1 is invalid: a term fault targets a rank, not a node"),
    ({"kind": "kill-node", "step": 1, "node": 1, "rank": 0},
     "faults.rank = 0 is invalid: a kill-node fault targets a node, not a rank"),
    ({"kind": "raise", "step": 1, "rank": -2},
     "faults.rank = -2 is invalid: a raise fault needs rank=N with N >= 0"),
])
def test_fault_spec_validation(kwargs: dict, expected: str | None) -> None:
    if expected is None:
        FaultSpec(**kwargs)
        return
    with pytest.raises(ConfigError) as err:
        FaultSpec(**kwargs)
    assert str(err.value) == expected


# ---------------------------------------------------------------------------- [[faults]] in TOML

TOML = """
[train]
steps = 50

[scaling]
num_workers = 4

[[faults]]
kind = "kill"
rank = 3
step = 20

[[faults]]
kind = "kill-node"
node = 1
step = 40
"""


def test_faults_load_from_toml_and_survive_a_dump(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(TOML)
    config = load_config(path)
    assert config.faults == (FaultSpec(kind="kill", rank=3, step=20),
                             FaultSpec(kind="kill-node", node=1, step=40))
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config
    assert JobConfig().faults == ()
    assert load_config(None).faults == ()


def test_faults_from_a_set_override() -> None:
    config = load_config(None, ['faults=[{kind="hang", rank=0, step=3}]'])
    assert config.faults == (FaultSpec(kind="hang", rank=0, step=3),)


@pytest.mark.parametrize(("text", "expected"), [
    ("faults = 3\n", "faults must be an array of tables ([[faults]]), got 3"),
    ('faults = ["kill:rank=1,step=2"]\n', "faults must be an array of tables ([[faults]])"),
    ('[[faults]]\nkind = "kill"\nrnak = 1\nstep = 2\n',
     "unknown key faults.rnak in [faults]; did you mean faults.rank? allowed: kind, step, rank, "
     "node, mbps"),
    ('[[faults]]\nkind = "kill"\nrank = "1"\nstep = 2\n',
     "faults.rank = '1' is invalid: expected a int"),
    ('[[faults]]\nkind = "kill"\nrank = 1\n',
     "[[faults]] table {'kind': 'kill', 'rank': 1} has no key step; required: kind, step"),
    ('[[faults]]\nkind = "kill"\nrank = 1\nstep = 500\n',
     "faults.step = 500 is invalid: must be <= train.steps = 200 (kill:rank=1,step=500)"),
    ('[[faults]]\nkind = "kill"\nrank = 2\nstep = 5\n',
     "faults.rank = 2 is invalid: must be < scaling.num_workers = 2 (kill:rank=2,step=5)"),
    ('[[faults]]\nkind = "drain"\nstep = 5\n',
     "faults.node = -1 is invalid: a drain fault needs node=N with N >= 1"),
])
def test_bad_faults_tables(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value)


# ---------------------------------------------------------------------------- FaultPlan

DRIVER = "node-driver"


def workers(*node_ids: str) -> list[WorkerPlace]:
    """Members in rank order, as ElasticGroup.form describes them."""
    return [WorkerPlace(rank=r, pid=100 + r, node_ip=f"10.0.0.{r}", node_id=n)
            for r, n in enumerate(node_ids)]


def test_nodes_are_numbered_from_the_drivers_by_lowest_rank() -> None:
    assert number_nodes(workers("b", "b", "a", "c", "a"), DRIVER) == {
        DRIVER: 0, "b": 1, "a": 2, "c": 3}
    # workers on the driver's node are on node 0, whatever their rank
    assert number_nodes(workers("a", DRIVER, "a"), DRIVER) == {DRIVER: 0, "a": 1}
    assert number_nodes([], DRIVER) == {DRIVER: 0}


def test_rank_faults_go_to_their_rank() -> None:
    faults = [parse_fault("kill:rank=1,step=5"), parse_fault("hang:rank=1,step=9"),
              parse_fault("raise:rank=0,step=3")]
    armed, unresolved = FaultPlan(faults).arm(workers("a", "a", "b"), DRIVER)
    assert armed == {1: [parse_fault("kill:rank=1,step=5"), parse_fault("hang:rank=1,step=9")],
                     0: [parse_fault("raise:rank=0,step=3")]}
    assert unresolved == []


def test_node_faults_go_to_the_lowest_rank_on_the_node() -> None:
    faults = [parse_fault("kill-node:node=2,step=8"), parse_fault("drain:node=1,step=4")]
    # node 1 = "b" (rank 0 is there), node 2 = "a" (lowest rank 1)
    armed, unresolved = FaultPlan(faults).arm(workers("b", "a", "b", "a"), DRIVER)
    assert armed == {1: [parse_fault("kill-node:node=2,step=8")],
                     0: [parse_fault("drain:node=1,step=4")]}
    assert unresolved == []


def test_the_drivers_node_is_node_0_even_when_workers_share_it() -> None:
    faults = [parse_fault("kill-node:node=1,step=8")]
    armed, _ = FaultPlan(faults).arm(workers(DRIVER, DRIVER, "x", "x"), DRIVER)
    assert armed == {2: [parse_fault("kill-node:node=1,step=8")]}


def test_faults_without_a_target_in_this_world_are_reported() -> None:
    faults = [parse_fault("kill:rank=3,step=5"), parse_fault("kill-node:node=2,step=6"),
              parse_fault("kill:rank=0,step=7")]
    plan = FaultPlan(faults)
    armed, unresolved = plan.arm(workers(DRIVER, "a"), DRIVER)
    assert armed == {0: [parse_fault("kill:rank=0,step=7")]}
    assert unresolved == [
        "fault kill:rank=3,step=5 has no target now: the world has 2 ranks",
        "fault kill-node:node=2,step=6 has no target now: the workers are on node(s) [0, 1] "
        "(node 0: the driver's)",
    ]
    # still pending: a later, larger world may have a target
    armed, unresolved = plan.arm(workers("a", "a", "b", "b"), DRIVER)
    assert armed == {3: [parse_fault("kill:rank=3,step=5")],
                     2: [parse_fault("kill-node:node=2,step=6")],
                     0: [parse_fault("kill:rank=0,step=7")]}
    assert unresolved == []


def test_no_workers_no_nodes() -> None:
    _, unresolved = FaultPlan([parse_fault("drain:node=1,step=2")]).arm([], DRIVER)
    assert unresolved == ["fault drain:node=1,step=2 has no target now: the workers are on "
                          "node(s) none (node 0: the driver's)"]


def test_a_fired_fault_is_never_armed_again() -> None:
    kill, hang = parse_fault("kill:rank=1,step=5"), parse_fault("hang:rank=0,step=9")
    plan = FaultPlan([kill, hang])
    world = workers("a", "a")
    assert plan.arm(world, DRIVER)[0] == {1: [kill], 0: [hang]}
    plan.fired(parse_fault("kill:rank=1,step=5"))  # compared by value, as specs travel
    assert plan.pending == [hang]
    assert plan.arm(world, DRIVER) == ({0: [hang]}, [])
    plan.fired(kill)  # heard twice (two polls): harmless
    plan.fired(hang)
    assert plan.arm(world, DRIVER) == ({}, [])


def test_the_fault_watch_arms_a_picked_world_and_logs_faults_with_no_target(
        tmp_path: Path) -> None:
    """The controller's side: given the picked places (no group), what each rank carries
    out; a fault with no target is logged as `fault_skipped` and stays pending."""
    from stalwart.core.events import read_jsonl
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.fault_watch import FaultWatch

    config = load_config(None, ["scaling.num_workers=4"])
    config = dataclasses.replace(config, faults=(parse_fault("kill:rank=3,step=5"),
                                                 parse_fault("kill-node:node=1,step=6")))
    watch = FaultWatch(config, EventLog(tmp_path / "events.jsonl"))
    assert watch.arm(workers("a", "a"), DRIVER) == {0: [parse_fault("kill-node:node=1,step=6")]}
    (skipped,) = read_jsonl(tmp_path / "events.jsonl")
    assert skipped["kind"] == "fault_skipped" and "kill:rank=3,step=5" in skipped["message"]
    assert watch.arm(workers("a", "a", "b", "b"), DRIVER) == {
        3: [parse_fault("kill:rank=3,step=5")], 0: [parse_fault("kill-node:node=1,step=6")]}
    assert dict(watch.fault_times()) == {}


# ---------------------------------------------------------------------------- FaultInjector


def fired_faults(injector: FaultInjector) -> list[tuple[str, int, int]]:
    return [(str(f.fault), f.rank, f.step) for f in injector.drain()]


def test_a_step_fault_is_told_then_carried_out_at_its_step() -> None:
    injector = FaultInjector(notice_timeout_s=0)
    injector.arm(1, [parse_fault("raise:rank=1,step=3")])
    injector.at_step(2)
    assert injector.drain() == []
    with pytest.raises(InjectedFault, match=r"injected fault raise:rank=1,step=3"):
        injector.at_step(3)
    assert fired_faults(injector) == [("raise:rank=1,step=3", 1, 3)]
    injector.at_step(3)  # fired once: not again
    assert injector.drain() == []


def test_snapshot_faults_strike_only_inside_the_snapshot() -> None:
    injector = FaultInjector(notice_timeout_s=0)
    injector.arm(0, [parse_fault("kill-staging:rank=0,step=4"),
                     parse_fault("kill-replicating:rank=0,step=6")])
    for step in range(1, 8):  # neither strikes at the start of a step
        injector.at_step(step)
    injector.mid_copy(6)  # nor at the other moment, nor at another step
    injector.before_payload(4)
    injector.mid_copy(5)
    assert injector.drain() == []
    # STRIKES_AT decides where each kind strikes
    assert STRIKES_AT == {"kill-staging": "mid_copy", "kill-replicating": "before_payload"}
    assert STRIKES_AT == {FaultKind.KILL_STAGING: "mid_copy",
                          FaultKind.KILL_REPLICATING: "before_payload"}


def test_a_fault_waits_for_the_controller_to_hear_of_it() -> None:
    injector = FaultInjector(notice_timeout_s=60)
    injector.arm(2, [parse_fault("raise:rank=2,step=1")])
    errors: list[BaseException] = []

    def train() -> None:
        try:
            injector.at_step(1)
        except InjectedFault as exc:
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    while not (fired := injector.drain()):
        time.sleep(0.01)
    assert [(str(f.fault), f.rank) for f in fired] == [("raise:rank=2,step=1", 2)]
    assert not errors  # told, not done yet
    injector.ack()
    thread.join(30)
    assert len(errors) == 1


def test_slow_makes_the_rank_sleep_twice_its_local_work(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fault_module.time, "sleep", slept.append)
    injector = FaultInjector(notice_timeout_s=0)
    injector.arm(0, [parse_fault("slow:rank=0,step=2")])
    injector.after_local_work(1.0)
    injector.at_step(2)
    injector.after_local_work(1.5)
    injector.disarm()  # a straggler stays one in its next worlds
    injector.after_local_work(0.5)
    assert slept == [SLOWDOWN * 1.5, SLOWDOWN * 0.5] == [3.0, 1.0]


def test_a_slow_link_makes_each_send_take_its_bytes_at_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fault_module.time, "sleep", slept.append)
    injector = FaultInjector(notice_timeout_s=0)
    injector.arm(1, [parse_fault("slow-link:rank=1,step=3,mbps=80")])
    injector.sending(1, 10_000_000)  # not yet: full speed
    injector.at_step(3)
    assert fired_faults(injector) == [("slow-link:rank=1,step=3,mbps=80", 1, 3)]
    injector.sending(3, 10_000_000)  # 80 Mbit/s = 10 MB/s
    injector.disarm()  # the link stays slow in the process's next worlds
    injector.sending(4, 5_000_000)
    assert slept == [1.0, 0.5]


def test_leaving_a_world_disarms_its_faults() -> None:
    injector = FaultInjector(notice_timeout_s=0)
    injector.arm(0, [parse_fault("raise:rank=0,step=2")])
    injector.disarm()
    injector.at_step(2)
    assert injector.drain() == []


def test_the_local_timer_tells_how_long_the_local_work_took() -> None:
    told: list[float] = []
    timer = LocalTimer(torch.device("cpu"), after_local_work=told.append)
    timer.done()
    assert len(told) == 1 and told[0] >= 0
    assert timer.seconds() >= told[0]  # the hook's own time counts as local work
