"""Ray's own messages on the driver go to RUN_DIR/ray.log while a run routes them; the workers'
output stays on the console. Ray's real printing function is called as its printing threads
call it (no Ray is started: printing needs none)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray._private import worker as ray_worker  # Ray loaded, as on a driver: routes install

from stalwart.core import ray_log
from stalwart.core.ray_log import RayLog

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

WORKER_DIED = ("A worker died or was killed while executing a task by an unexpected system "
               "error. Some common causes include: (1) the process was killed by the OOM "
               "killer due to high memory usage")


def _print_as_ray(pid: object, line: str, **more: object) -> None:
    """What Ray's driver threads do with a batch: its error listener's (pid "raylet"), or a
    worker's output as the log monitor sends it."""
    ray_worker.print_to_stdstream({"pid": pid, "lines": [line], "is_err": False,
                               "ip": "10.0.0.1", "localhost": "10.0.0.1", **more},
                              ignore_prefix=False)


def test_rays_paragraphs_go_to_the_run_dir_and_the_workers_output_to_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "ray.log"
    with RayLog(log):
        _print_as_ray("raylet", WORKER_DIED)
        _print_as_ray("gcs_server", "a line the GCS logged")
        _print_as_ray(4242, "the task printed this", actor_name="stalwart-worker-r1-g0")
    out = capsys.readouterr().out
    assert "killed by the OOM killer" not in out and "GCS logged" not in out
    assert "(stalwart-worker-r1-g0 pid=4242)" in out and "the task printed this" in out
    written = log.read_text().splitlines()
    assert len(written) == 2
    assert written[0].endswith(f"(raylet) {WORKER_DIED}")  # after the time, no colours
    assert "\x1b" not in log.read_text()
    assert written[1].endswith("(pid=gcs_server) a line the GCS logged")

    # Just after the run: what Ray says of the workers its end killed is still the run's.
    _print_as_ray("raylet", "the run's last worker died")
    assert capsys.readouterr().out == "" and "last worker died" in log.read_text()


def test_past_its_linger_a_run_leaves_rays_messages_to_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_log, "LINGER_S", 0.0)
    log = tmp_path / "ray.log"
    with RayLog(log):
        pass
    _print_as_ray("raylet", "after the run")  # Ray prints on the console, as it does
    assert "(raylet)" in capsys.readouterr().out and not log.exists()


def test_nested_runs_route_to_the_newest_and_nothing_is_written_until_ray_speaks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outer, inner = tmp_path / "outer.log", tmp_path / "inner.log"
    with RayLog(outer):
        with RayLog(inner):
            _print_as_ray("raylet", "to the inner run")
        assert not outer.exists()  # nothing said to it yet
        _print_as_ray("raylet", "to the outer run")  # still running: it wins over the ended
    assert "to the inner run" in inner.read_text()
    assert "to the outer run" in outer.read_text() and "inner" not in outer.read_text()
    assert capsys.readouterr().out == ""


def test_a_log_that_cannot_be_written_leaves_the_line_on_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine.txt"
    mine.write_text("my file\n")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "ray.log").symlink_to(mine)
    for log in (tmp_path / "missing" / "ray.log", planted / "ray.log"):
        with RayLog(log):
            _print_as_ray("raylet", f"nowhere to go: {log.parent.name}")  # raises nothing
    err = capsys.readouterr().err
    assert "nowhere to go: missing" in err and "nowhere to go: planted" in err
    assert mine.read_text() == "my file\n"  # never written through the link
