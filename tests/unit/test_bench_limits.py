"""The limits benchmark's parts that need no Ray and no DCP daemon (bench/limits.py): the
ratios, verdicts and table, the alternating rounds, and its staging, storage and raw TCP
measurements on a state of a few MiB. The whole run (Ray actors, DCP's process-based save)
is the benchmark, not a test; the figures are never asserted."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from bench import limits

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TINY_GIB = 0.002  # about 2 MiB of weights and Adam moments


@pytest.fixture
def one_thread():  # noqa: ANN201
    """The bench runs torch on one thread, as a worker does; the test process gets its own
    setting back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_row_is_met_at_the_goal_and_not_below_it() -> None:
    met = limits.row("stalwart", 2.0, "plain", 2.5)
    assert met["ratio"] == pytest.approx(0.8) and met["verdict"] == "MET"
    assert limits.row("stalwart", 1.9, "plain", 2.5)["verdict"] == "NOT MET"
    assert limits.row("stalwart", 3.0, "plain", 2.5)["verdict"] == "MET"


def test_a_row_without_a_figure_or_a_goal_has_no_verdict() -> None:
    assert limits.row("stalwart", None, "plain", 2.5)["verdict"] == "-"
    assert limits.row("stalwart", 1.0, "plain", None)["ratio"] is None
    assert limits.row("info", 1.0, "plain", 2.0, goal=None)["verdict"] == "-"
    assert limits.verdict(0.5, None) == "-"


def test_the_table_prints_figures_ratio_goal_and_verdict() -> None:
    rows = [limits.row("restore", 2.0, "raw TCP", 2.5),
            limits.row("seal", None, "copy_", 4.0, goal=None)]
    header, first, second = limits.table(rows)
    assert header == ["path", "measured", "baseline", "", "ratio", "goal", "verdict"]
    assert first == ["restore", "2.00 GB/s", "2.50 GB/s", "raw TCP", "0.80x", ">= 0.8x", "MET"]
    assert second == ["seal", "- GB/s", "4.00 GB/s", "copy_", "-", "-", "-"]


def test_gbps_and_the_fastest_round() -> None:
    assert limits.gbps(2 * 10**9, 0.5) == pytest.approx(4.0)
    assert limits.gbps(10, None) is None and limits.gbps(10, 0.0) is None
    assert limits.best([0.3, 0.1, 0.2]) == 0.1 and limits.best([]) is None


def test_rounds_alternate_which_side_goes_first() -> None:
    calls: list[str] = []

    def side(name: str, seconds: float):  # noqa: ANN202
        return lambda: calls.append(name) or seconds

    a, b = limits.alternate(3, side("a", 1.0), side("b", 2.0))
    assert (a, b) == ([1.0] * 3, [2.0] * 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_the_flags_default_to_a_gib_and_take_a_smaller_one() -> None:
    args = limits.parse_args([])
    assert (args.gib, args.rounds, args.io_rounds, args.stall_rounds) == (1.0, 5, 3, 2)
    assert args.out.endswith("bench/results/limits.json")
    assert limits.parse_args(["--gib", "0.05"]).gib == 0.05
    with pytest.raises(SystemExit):
        limits.parse_args(["--gib", "0"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's, with no group
def test_staging_and_the_storage_write_measure_a_tiny_state(one_thread, tmp_path: Path) -> None:
    state = limits.BenchState(TINY_GIB, seed=0)
    staging = limits.staging_part(state, 2)
    assert len(staging["stage_s"]) == len(staging["memcpy_s"]) == len(staging["seal_s"]) == 2
    tensors = sum(t.nbytes for t in limits._tensors(state.state_dict()))
    assert staging["tensor_bytes"] == tensors <= staging["nbytes"]  # slots are 64-aligned
    shard = staging["stager"].stage(limits.STEP)
    shard.seal()
    storage = limits.storage_part(shard, tmp_path, 1)
    assert len(storage["save_s"]) == len(storage["write_s"]) == 1
    assert set(storage["passes"]) == {"copy_s", "sha256_s", "zip_crc32_s"}
    # Every save was committed (a manifest each); the plain write wrote the same bytes.
    manifests = list((tmp_path / "ckpt").glob("*/manifest.json"))
    assert len(manifests) == 2  # the warm-up save and the measured one
    assert json.loads(manifests[0].read_text())["run_id"] == "limits"
    assert (tmp_path / "plain-0.bin").read_bytes() == shard.buffer.numpy().tobytes()
    assert len(storage["save_cpu_s"]) == len(storage["write_cpu_s"]) == 1
    rows = limits.staging_rows(staging) + limits.storage_rows(storage)
    assert all(r["measured"] and r["baseline"] for r in rows)


def test_raw_tcp_moves_the_holders_snapshot_into_the_restorers_buffer(one_thread) -> None:
    holder, restorer = limits.Rank(TINY_GIB, 1), limits.Rank(TINY_GIB, 2)
    layout = holder.hold()
    port = restorer.listen(layout.nbytes)
    received: list[float] = []
    thread = threading.Thread(target=lambda: received.append(restorer.receive()))
    thread.start()
    holder.send(port)
    thread.join(timeout=30)
    shard = holder.tier.store.get(limits.GEN, limits.SOURCE, limits.STEP)
    assert received and torch.equal(restorer._inbox, shard.buffer)
    assert holder.crc_s(2) >= 0.0  # the held snapshot still matches its CRC32
