"""scaling.placement_strategy = "SPREAD": a world takes its ranks from the nodes that hold the
fewest of it first, so the ranks spread over the nodes and the spares are the workers left on
a shared node, whichever warmed up first (tests/ray/test_spread_placement.py: on a cluster)."""

from __future__ import annotations

import pytest

from stalwart.core.config import load_config
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator.worker_group import ElasticGroup, Worker, spread_first
from tests.cli_helpers import REFERENCE_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _worker(key: str, node: str) -> Worker:
    return Worker(key=key, actor=None, warm=None,
                  place=WorkerPlace(rank=-1, pid=1, node_ip="10.0.0.1", node_id=node))


def _keys(workers: list[Worker]) -> list[str]:
    return [w.key for w in workers]


def _node(w: Worker) -> str:
    return w.place.node_id


def test_two_workers_warm_on_one_node_first_yet_the_ranks_spread() -> None:
    # The head's two warmed before the other node's one: in warm order both would be ranks.
    idle = [_worker("a1", "head"), _worker("a2", "head"), _worker("b1", "other")]
    assert _keys(spread_first([], idle, _node)) == ["a1", "b1", "a2"]


def test_the_survivors_nodes_count_and_each_nodes_workers_keep_their_order() -> None:
    idle = [_worker("a1", "A"), _worker("a2", "A"), _worker("b1", "B"), _worker("c1", "C"),
            _worker("c2", "C")]
    # A survivor on A and one on C: B is emptiest, then A and C in turn (A warmed first).
    assert _keys(spread_first(["A", "C"], idle, _node)) == ["b1", "a1", "c1", "a2", "c2"]
    assert spread_first(["A"], [], _node) == []


def _group(strategy: str, idle: list[Worker], members: list[Worker] = ()) -> ElasticGroup:
    """The group's picking state alone: `pick` reads the config and the pools, not Ray."""
    group = ElasticGroup.__new__(ElasticGroup)
    group.config = load_config(REFERENCE_CONFIG, [f"scaling.placement_strategy={strategy}"])
    group.members, group.idle = list(members), list(idle)
    return group


@pytest.mark.parametrize(("strategy", "ranks"), [("SPREAD", ["a1", "b1"]),
                                                 ("PACK", ["a1", "a2"])])
def test_pick_spreads_only_under_spread(strategy: str, ranks: list[str]) -> None:
    idle = [_worker("a1", "head"), _worker("a2", "head"), _worker("b1", "other")]
    group = _group(strategy, idle)
    places = group.pick(2, generation=0)
    assert _keys(group.members) == ranks and [p.rank for p in places] == [0, 1]
    assert len(group.idle) == 1  # the spare


def test_survivors_keep_their_ranks_and_the_newcomer_comes_from_another_node() -> None:
    survivor = _worker("s", "A")
    group = _group("SPREAD", [_worker("a", "A"), _worker("b", "B")], members=[survivor])
    group.pick(2, generation=1)
    assert _keys(group.members) == ["s", "b"] and _keys(group.idle) == ["a"]
