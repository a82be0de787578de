"""A run directory from someone else, with symbolic links planted at the names stalwart writes:
no write follows one. Whole files (config.toml, run_id, report.png, profiler traces) replace
the link with a regular file; the logs (events.jsonl, metrics.jsonl) and the directories of
files (profile/, tensorboard/) refuse it with one error naming it. Each victim is a file
outside the run directory that must keep its bytes."""

from __future__ import annotations

import os
import socket
import stat
import time
import zlib
from pathlib import Path

import pytest

from stalwart.core import events as E
from stalwart.core.config import JobConfig, load_config
from stalwart.core.errors import RunDirError
from stalwart.core.safe_files import (
    make_dir_nofollow,
    open_append_nofollow,
    write_file_atomically,
)
from stalwart.orchestrator.profiles import save_trace
from stalwart.report import main as report
from stalwart.run_dir import RunDir
from stalwart.workers.reports import ProfileReport
from tests.unit.test_report import clean_run, write_run

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VICTIM_BYTES = b"the victim's own bytes\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "victim"
    path.parent.mkdir()
    path.write_bytes(VICTIM_BYTES)
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def replaced(path: Path) -> bytes:
    """The bytes of `path`, which must now be a regular file, not a link."""
    assert not path.is_symlink() and stat.S_ISREG(path.lstat().st_mode)
    return path.read_bytes()


# ----------------------------------------------------------- whole files: the link is replaced

def test_config_toml_replaces_a_link_and_ignores_the_old_temporary_name(
        run: Path, victim: Path) -> None:
    plant(run / "config.toml", victim)
    plant(run / "config.toml.tmp", victim)  # the name it used to write first
    RunDir(run).write_config(JobConfig())
    assert victim.read_bytes() == VICTIM_BYTES
    replaced(run / "config.toml")
    assert load_config(run / "config.toml") == JobConfig()
    assert (run / "config.toml.tmp").is_symlink()  # not ours: left alone
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "config.toml.tmp"]


def test_run_id_replaces_a_link(run: Path, victim: Path) -> None:
    plant(run / "run_id", victim)
    RunDir(run).write_run_id("abc123")
    assert victim.read_bytes() == VICTIM_BYTES
    assert replaced(run / "run_id") == b"abc123\n"


def test_a_dangling_link_is_replaced_and_its_target_never_made(run: Path,
                                                               victim: Path) -> None:
    missing = victim.parent / "would-be-made"
    plant(run / "run_id", missing)
    RunDir(run).write_run_id("abc123")
    assert not missing.exists()
    assert replaced(run / "run_id") == b"abc123\n"


def test_an_atomic_write_keeps_the_mode_a_plain_write_gets(tmp_path: Path) -> None:
    write_file_atomically(tmp_path / "new", "x")
    (tmp_path / "plain").write_text("x")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == stat.S_IMODE(
        (tmp_path / "plain").stat().st_mode)


def test_a_failed_atomic_write_leaves_the_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_file_atomically(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_profiler_trace_replaces_a_link_at_its_name(run: Path, victim: Path) -> None:
    # A dangling link is a free name (so it is chosen); the link to the victim is taken.
    plant(run / "profile" / "rank0-step5-6.json", victim.parent / "gone")
    plant(run / "profile" / "rank0-step5-6-2.json", victim)
    plant(run / "profile" / "rank0-step5-6.json.tmp", victim)  # the old temporary name
    report = ProfileReport(rank=0, generation=0, steps=(5, 6),
                           trace_zlib=zlib.compress(b"{}"), export_s=0.1)
    first = save_trace(run / "profile", report)
    second = save_trace(run / "profile", report)
    assert victim.read_bytes() == VICTIM_BYTES and not (victim.parent / "gone").exists()
    assert first.name == "rank0-step5-6.json" and replaced(first) == b"{}"
    assert second.name == "rank0-step5-6-3.json" and replaced(second) == b"{}"


def test_report_png_replaces_a_link(run: Path, victim: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    write_run(run / "r", *clean_run())
    plant(run / "r" / "report.png", victim)
    assert report(str(run / "r")) == 0
    assert victim.read_bytes() == VICTIM_BYTES
    assert replaced(run / "r" / "report.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"figure: {run / 'r' / 'report.png'}" in capsys.readouterr().out


def test_report_out_named_by_the_user_is_written_whole_too(run: Path, victim: Path) -> None:
    pytest.importorskip("matplotlib")
    write_run(run / "r", *clean_run())
    out = plant(run / "mine.png", victim)
    assert report(str(run / "r"), out=str(out)) == 0
    assert victim.read_bytes() == VICTIM_BYTES
    assert replaced(out)[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------- logs: the link is refused

@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl"])
def test_a_log_refuses_a_link(run: Path, victim: Path, name: str) -> None:
    plant(run / name, victim)
    rd = RunDir(run)
    with pytest.raises(RunDirError, match=f"{name} is a symbolic link; stalwart writes there "
                                          f"only to a regular file and never through a "
                                          f"symbolic link: remove it"):
        if name == "events.jsonl":
            rd.events.emit(E.Finished(time=1.0, step=1))
        else:
            rd.metrics.write(clean_run()[1][0])
    assert victim.read_bytes() == VICTIM_BYTES and (run / name).is_symlink()


def test_a_log_refuses_a_dangling_link_without_making_its_target(run: Path,
                                                                 victim: Path) -> None:
    missing = victim.parent / "would-be-made"
    plant(run / "events.jsonl", missing)
    with pytest.raises(RunDirError, match="events.jsonl is a symbolic link"):
        RunDir(run).events.emit(E.Finished(time=1.0, step=1))
    assert not missing.exists()


def test_a_log_refuses_a_fifo_instead_of_waiting_for_a_reader(run: Path) -> None:
    os.mkfifo(run / "events.jsonl")
    with pytest.raises(RunDirError, match="events.jsonl is not a regular file"):
        RunDir(run).events.emit(E.Finished(time=1.0, step=1))


def test_a_log_still_appends_to_its_own_file(run: Path) -> None:
    rd = RunDir(run)
    rd.events.emit(E.Finished(time=1.0, step=1))
    rd.events.emit(E.Finished(time=2.0, step=2))
    assert [e.step for e in E.read_events(rd.events.path)] == [1, 2]
    with open_append_nofollow(rd.events.path) as f:
        assert f.encoding == "utf-8"


# ------------------------------------------------------ directories of files: the link is refused

def test_a_linked_profile_directory_is_refused(run: Path, victim: Path) -> None:
    plant(run / "profile", victim.parent)
    report = ProfileReport(rank=0, generation=0, steps=(5, 6),
                           trace_zlib=zlib.compress(b"{}"), export_s=0.1)
    with pytest.raises(RunDirError, match="profile is a symbolic link"):
        save_trace(run / "profile", report)
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_make_dir_nofollow_makes_a_directory_and_refuses_a_dangling_link(
        run: Path, tmp_path: Path) -> None:
    assert make_dir_nofollow(run / "a" / "b").is_dir()
    plant(run / "c", tmp_path / "nowhere")
    with pytest.raises(RunDirError, match="c is a symbolic link"):
        make_dir_nofollow(run / "c")
    assert not (tmp_path / "nowhere").exists()


def test_tensorboard_refuses_a_linked_directory(run: Path, victim: Path) -> None:
    pytest.importorskip("tensorboardX")
    from stalwart.integrations.tensorboard import TensorBoardLogger

    plant(run / "tensorboard", victim.parent)
    with pytest.raises(RunDirError, match="tensorboard is a symbolic link"):
        TensorBoardLogger(run / "tensorboard").on_metrics(clean_run()[1][0])
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_tensorboard_file_name_cannot_be_planted_beforehand(run: Path, victim: Path) -> None:
    """tensorboardX names its file by the second and the host: links at every such name for
    the next seconds catch nothing, as the name ends in a random part."""
    pytest.importorskip("tensorboardX")
    from stalwart.integrations.tensorboard import TensorBoardLogger

    now = int(time.time())
    for t in range(now - 1, now + 30):
        plant(run / "tensorboard" / f"events.out.tfevents.{t}.{socket.gethostname()}", victim)
    tb = TensorBoardLogger(run / "tensorboard")
    tb.on_metrics(clean_run()[1][0])
    tb.on_end(None)
    assert victim.read_bytes() == VICTIM_BYTES
    written = [p for p in (run / "tensorboard").iterdir() if not p.is_symlink()]
    assert len(written) == 1 and written[0].stat().st_size > 0


# ------------------------------------------------------------- the run's check before it starts

@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl", "profile", "tensorboard",
                                  "wandb"])
def test_the_run_dir_check_names_a_link_it_would_refuse(run: Path, victim: Path,
                                                        name: str) -> None:
    plant(run / name, victim if "." in name else victim.parent)
    with pytest.raises(RunDirError, match=f"{name} is a symbolic link; stalwart never "
                                          f"writes through one"):
        RunDir(run).check_no_links()


def test_the_run_dir_check_passes_a_plain_run_dir(run: Path) -> None:
    write_run(run / "r", *clean_run())
    (run / "r" / "profile").mkdir()
    RunDir(run / "r").check_no_links()
