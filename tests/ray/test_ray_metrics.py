"""A run's health in Ray's own metrics, scraped from the Prometheus endpoint of a real Ray
node as Prometheus would; and `run.dashboard = true` serving Ray's dashboard while it runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from stalwart.core.config import load_config, parse_fault
from stalwart.core.events import read_jsonl
from stalwart.trainer import Trainer
from tests.cli_helpers import STALWART, sets

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

pytest.importorskip("sklearn")

DIGITS_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


@pytest.fixture(scope="module")
def cluster():
    """One Ray node that collects metrics and reports them every second."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": 1000, "worker_niceness": 0,
                           "prestart_worker_first_driver": False}})
    ray.init(address=c.address, logging_level="WARNING")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _scrape(names: tuple[str, ...], settled=lambda found: True,
            timeout_s: float = 60.0) -> dict[str, list[str]]:
    """Every sample line of the named series on the node's endpoint, once all are there and
    `settled` holds: the driver's last values reach the endpoint a report interval later."""
    import ray

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + timeout_s
    while True:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        found = {n: [line for line in body.splitlines() if line.startswith(n + "{")]
                 for n in names}
        if (all(found.values()) and settled(found)) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def test_failures_recoveries_and_goodput_reach_prometheus(cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "metrics-run"
    config = load_config(DIGITS_CONFIG, [
        "train.steps=60", "failure.max_failures=1", "run.progress=false",
        "checkpoint.persist_every=30", "scaling.spare_workers=0"])
    config = dataclasses.replace(config, faults=(parse_fault("kill:rank=1,step=25"),))
    result = Trainer(config, run_dir=run_dir, address=cluster.address).fit()
    assert result.state == "FINISHED"

    names = ("ray_stalwart_failures_total", "ray_stalwart_recoveries_total",
             "ray_stalwart_recovery_seconds_count", "ray_stalwart_goodput",
             "ray_stalwart_step", "ray_stalwart_tokens_per_second", "ray_stalwart_world_size")
    tag = f'run="{run_dir.name}"'

    def at_last_step(found: dict[str, list[str]]) -> bool:
        return any(tag in line and _value(line) == 60 for line in found["ray_stalwart_step"])

    found = _scrape(names, settled=at_last_step)
    assert all(found.values()), {n: bool(v) for n, v in found.items()}
    mine = {n: [line for line in lines if tag in line] for n, lines in found.items()}
    (failures,) = mine["ray_stalwart_failures_total"]
    assert 'kind="worker_died"' in failures and _value(failures) == 1
    (recoveries,) = mine["ray_stalwart_recoveries_total"]
    event = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "recovered")
    assert f'source="{event["source"]}"' in recoveries and _value(recoveries) == 1
    assert _value(mine["ray_stalwart_recovery_seconds_count"][0]) == 1
    assert _value(mine["ray_stalwart_step"][0]) == 60
    assert _value(mine["ray_stalwart_world_size"][0]) == 2
    assert 0 < _value(mine["ray_stalwart_goodput"][0]) <= 1
    assert _value(mine["ray_stalwart_tokens_per_second"][0]) > 0


def test_run_dashboard_serves_rays_dashboard_while_the_run_trains(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        # The dashboard's address is printed as Ray starts, seconds before the first step:
        # 60 steps keep the run going well past the request.
        [STALWART, "run", str(DIGITS_CONFIG), *sets("run.dashboard=true", "train.steps=60",
                                                    "run.progress=false"),
         "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            match = re.search(r"Ray dashboard at (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url is not None, "no dashboard address printed"
        assert "it asks for Ray's token" in line
        token = os.environ.get("RAY_AUTH_TOKEN") or \
            (Path.home() / ".ray" / "auth_token").read_text().strip()
        request = urllib.request.Request(f"{url}/api/version",
                                         headers={"Authorization": f"Bearer {token}"})
        version = json.loads(urllib.request.urlopen(request, timeout=30).read())
        assert version["ray_version"] == __import__("ray").__version__
        rest = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
