"""A run directory handed over with symbolic links planted in it, from the command line: `report`
replaces a link at report.png with its figure, and `run` refuses a link at events.jsonl before
anything starts. The file each link points at keeps its bytes. Neither command starts Ray."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, STALWART, stalwart
from tests.unit.test_report import clean_run, write_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

VICTIM_BYTES = b"the victim's own bytes\n"


def victim_file(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "victim"
    path.parent.mkdir()
    path.write_bytes(VICTIM_BYTES)
    return path


def test_report_replaces_a_link_at_report_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    victim = victim_file(tmp_path)
    run = write_run(tmp_path / "run", *clean_run())
    (run / "report.png").symlink_to(victim)

    proc = stalwart("report", "run", cwd=tmp_path)
    assert f"figure: {Path('run') / 'report.png'}" in proc.stdout
    assert victim.read_bytes() == VICTIM_BYTES
    png = run / "report.png"
    assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_refuses_a_link_at_events_jsonl_before_it_starts(tmp_path: Path) -> None:
    victim = victim_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(victim)
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()

    proc = subprocess.run([STALWART, "run", str(REFERENCE_CONFIG), "--run-dir", "run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "stalwart: error: run dir run: events.jsonl is a symbolic link; stalwart never writes "
        "through one: remove it, or choose another --run-dir"]
    assert victim.read_bytes() == VICTIM_BYTES
    assert [p.name for p in run.iterdir()] == ["events.jsonl"]  # nothing written
    assert not list(ray_tmp.iterdir())  # Ray never started
