"""The CLI as a user types it, before any training: `stalwart --version`, a bare `stalwart`,
a misspelled command or config key, and output piped into a reader that stops reading
(`| head`) ending quietly. Each case is one quick subprocess on a synthetic run directory."""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from stalwart.core import events as E
from tests.cli_helpers import REFERENCE_CONFIG, STALWART
from tests.unit.test_report import clean_run, write_run
from tests.unit.test_run_status import make_run, started

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as the shell's own tools end


def _stalwart(*args: str, cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STALWART, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, **kwargs)


def test_version_is_the_installed_packages(tmp_path: Path) -> None:
    done = _stalwart("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == f"stalwart {version('stalwart')}\n"


def test_a_bare_stalwart_prints_the_commands(tmp_path: Path) -> None:
    done = _stalwart(cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: stalwart [-h] [--version] COMMAND ...")
    for command in ("run", "sweep", "report", "status", "submit", "stop", "export", "plan"):
        assert f"\n    {command} " in done.stderr


def test_a_misspelled_command_and_key_name_the_one_meant(tmp_path: Path) -> None:
    typo = _stalwart("reprot", "run", cwd=tmp_path)
    assert typo.returncode == 2 and typo.stderr.startswith(
        "stalwart: error: argument COMMAND: invalid choice: 'reprot'; did you mean 'report'?")
    key = _stalwart("run", str(REFERENCE_CONFIG), "--set", "train.setps=5", cwd=tmp_path)
    assert key.returncode == 2 and key.stderr == (
        "stalwart: error: unknown key train.setps in [train]; did you mean train.steps? "
        "allowed: steps, global_batch_size, micro_batch_size, lr, min_lr_ratio, warmup_steps, "
        "weight_decay, grad_clip, seed, precision\n")
    assert not (tmp_path / "runs").exists()


def test_report_into_head_prints_its_first_line_and_no_broken_pipe(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", *clean_run())
    piped = subprocess.run(f"{STALWART} report run | head -1", shell=True, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert piped.stdout == "run            run (finished)\n"
    assert "BrokenPipe" not in piped.stderr and "Traceback" not in piped.stderr
    assert (run / "report.png").exists() or "no figure" in piped.stderr


@pytest.mark.parametrize("command", [("report", "run"), ("status", "run"), ("--help",)])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path, command: tuple[str, ...]
                                                ) -> None:
    """The reader is gone before the first line is written: every write fails (the case
    `| head` meets once it has read its lines)."""
    if command[0] == "report":
        write_run(tmp_path / "run", *clean_run())
    else:
        make_run(tmp_path, [started(), E.Stopped(time=2e9, step=25)], rows_to=20)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([STALWART, *command], cwd=tmp_path, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    # --help is argparse's own: it drops what it cannot write and exits 0.
    assert done.returncode == (0 if command == ("--help",) else EXIT_BROKEN_PIPE)
    assert "BrokenPipe" not in done.stderr and "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
