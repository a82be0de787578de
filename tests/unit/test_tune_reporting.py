"""What a run hands to Ray Tune (TuneReporter), and the checkpoint copy a trial starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import (
    CheckpointInfo,
    read_checkpoint,
    read_step_dir,
    verify,
)
from stalwart.checkpointing.storage.transfer import copy_checkpoint
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.events import CheckpointCommitted, MetricsRow
from stalwart.integrations.tune.reporter import TuneReporter
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STAGING = Path("/nonexistent")  # each test's own, set by the `staging` fixture


@pytest.fixture(autouse=True)
def staging(tmp_path: Path) -> Path:
    global STAGING
    STAGING = tmp_path / "staging"
    return STAGING


def _checkpoint(root: Path, step: int) -> str:
    step_dir = root / f"step_{step:09d}"
    step_dir.mkdir(parents=True)
    (step_dir / "__0_0.distcp").write_bytes(bytes(range(256)) * 10)
    (step_dir / ".metadata").write_bytes(b"meta")
    write_manifest(str(root), step, {"world_size": 1}, key=signing_key())
    return str(step_dir)


@pytest.fixture()
def reports(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, Any], Any]]:
    """What Tune would receive (this is a pure unit test: no Tune session exists)."""
    from ray import tune

    seen: list[tuple[dict[str, Any], Any]] = []

    def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
        # What Tune would copy: the files as they are at the call (they go after it).
        files = None if checkpoint is None else sorted(p.name for p in
                                                        Path(checkpoint.path).iterdir())
        seen.append((metrics, files))

    monkeypatch.setattr(tune, "report", report)
    return seen


def _metrics(step: int, **extra: Any) -> MetricsRow:
    return MetricsRow(step=step, loss=5.0 - step / 10, lr=1e-3, tokens_per_s=100.0,
                      world_size=2, samples_seen=8 * step, time=1.0 * step, **extra)


def _row(step: int, **extra: Any) -> dict[str, Any]:
    """The row as metrics.jsonl holds it, which is what Tune is sent."""
    return _metrics(step, **extra).to_row()


def test_every_row_is_reported_with_val_loss_carried(reports: list) -> None:
    r = TuneReporter(STAGING)
    r.on_metrics(_metrics(5))
    r.on_metrics(_metrics(10, val_loss=4.0))
    r.on_metrics(_metrics(15))
    assert [m["step"] for m, _ in reports] == [5, 10, 15]
    assert "val_loss" not in reports[0][0]
    assert reports[2][0]["val_loss"] == 4.0 and all(c is None for _, c in reports)


def test_reports_wait_for_the_sweeps_metric(reports: list) -> None:
    r = TuneReporter(STAGING, metric="val_loss")
    r.on_metrics(_metrics(5))
    r.on_metrics(_metrics(10, val_loss=4.0))
    r.on_metrics(_metrics(15))
    assert [(m["step"], m["val_loss"]) for m, _ in reports] == [(10, 4.0), (15, 4.0)]


def test_a_task_metric_is_reported_and_its_validation_mean_carried(reports: list) -> None:
    r = TuneReporter(STAGING, metric="val_accuracy")
    r.on_metrics(_metrics(5, task_metrics={"accuracy": 0.5}))
    r.on_metrics(_metrics(10, val_loss=4.0, task_metrics={"accuracy": 0.6,
                                                          "val_accuracy": 0.55}))
    r.on_metrics(_metrics(15, task_metrics={"accuracy": 0.7}))
    assert [(m["step"], m["accuracy"], m["val_accuracy"]) for m, _ in reports] == [
        (10, 0.6, 0.55), (15, 0.7, 0.55)]


def test_a_metric_the_run_never_reports_fails_the_trial_at_once(reports: list) -> None:
    from types import SimpleNamespace

    from stalwart.core.errors import TaskError

    typo = TuneReporter(STAGING, metric="acuracy")  # a typo of the task's accuracy
    with pytest.raises(TaskError, match=r"metric 'acuracy' is not reported: the run's "
                                        r"metrics rows have accuracy, loss, lr"):
        typo.on_metrics(_metrics(5, task_metrics={"accuracy": 0.5}))
    # A validation mean can only be judged on a validation row.
    val = TuneReporter(STAGING, metric="val_acuracy")
    val.on_metrics(_metrics(5, task_metrics={"accuracy": 0.5}))
    with pytest.raises(TaskError, match=r"metric 'val_acuracy' is not reported: the run's "
                                        r"validation metrics rows have accuracy, loss"):
        val.on_metrics(_metrics(10, val_loss=1.0, task_metrics={"accuracy": 0.5,
                                                               "val_accuracy": 0.4}))
    # A run that ended without any validation row: the backstop at the end.
    late = TuneReporter(STAGING, metric="val_accuracy")
    late.on_metrics(_metrics(5, task_metrics={"accuracy": 0.5}))
    late.on_end(SimpleNamespace(state="STOPPED"))  # stopped early: it may simply not have come
    with pytest.raises(TaskError, match=r"metric 'val_accuracy' was never reported"):
        late.on_end(SimpleNamespace(state="FINISHED"))
    assert reports == []


def test_a_checkpoint_goes_with_metrics_of_its_step_or_later(tmp_path: Path,
                                                              reports: list) -> None:
    path = _checkpoint(tmp_path, 20)
    r = TuneReporter(STAGING)
    r.on_metrics(_metrics(20))
    r.on_event(CheckpointCommitted(save_s=0.1, step=20, path=path))
    r.on_metrics(_metrics(15))  # a row of a recovery that went back: too old for step 20
    r.on_metrics(_metrics(25))
    r.on_metrics(_metrics(30))
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports] == [
        (20, None), (15, None), (25, 20), (30, None)]
    assert reports[2][1] == [".metadata", "__0_0.distcp", "manifest.json"]
    assert not list(STAGING.iterdir())  # Tune has its copy: the staged one is gone


def test_a_checkpoint_deleted_by_retention_still_reaches_tune(tmp_path: Path,
                                                              reports: list) -> None:
    """keep_last deletes old checkpoints while the controller is busy reporting: what was
    staged at its commit event survives (hard links), what was gone by then is skipped."""
    import shutil

    r = TuneReporter(STAGING)
    kept, gone = _checkpoint(tmp_path, 5), _checkpoint(tmp_path, 10)
    shutil.rmtree(gone)
    r.on_event(CheckpointCommitted(save_s=0.1, step=10, path=gone))
    r.on_event(CheckpointCommitted(save_s=0.1, step=5, path=kept))
    shutil.rmtree(kept)  # retention, after the event
    r.on_metrics(_metrics(10))
    assert reports == [({**_row(10), "checkpoint_step": 5},
                        [".metadata", "__0_0.distcp", "manifest.json"])]


def test_the_final_checkpoint_is_reported_at_the_end(tmp_path: Path, reports: list) -> None:
    r = TuneReporter(STAGING)
    r.on_metrics(_metrics(40))
    r.on_event(CheckpointCommitted(save_s=0.1, step=40, path=_checkpoint(tmp_path, 40)))
    r.on_end(None)
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports] == [(40, None), (40, 40)]
    r.on_end(None)
    assert len(reports) == 2  # nothing left to report


def test_copy_checkpoint_to_another_storage(tmp_path: Path) -> None:
    source = read_step_dir(_checkpoint(tmp_path / "a", 30))
    assert source.step == 30  # from the manifest
    copy = copy_checkpoint(source, "memory://stalwart-test/b")
    assert copy.path == "memory://stalwart-test/b/step_000000030"
    verify(read_checkpoint("memory://stalwart-test/b", 30), trust())
    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        copy_checkpoint(source, "memory://stalwart-test/b")
    whole = copy_checkpoint(source, str(tmp_path / "c"), as_step_dir=False)
    assert whole.path == str(tmp_path / "c")


def test_an_uncommitted_directory_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="is not committed"):
        read_step_dir(str(tmp_path / "half"))


def test_for_pbt_a_checkpoint_steps_row_waits_for_its_checkpoint(tmp_path: Path,
                                                                  reports: list) -> None:
    r = TuneReporter(STAGING, with_checkpoints=True)
    r.on_metrics(_metrics(5))
    r.on_metrics(_metrics(10))
    assert reports == []  # held: no checkpoint for them yet
    r.on_event(CheckpointCommitted(save_s=0.1, step=5, path=_checkpoint(tmp_path, 5)))
    r.on_event(CheckpointCommitted(save_s=0.1, step=10, path=_checkpoint(tmp_path, 10)))
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports] == [(5, 5), (10, 10)]
    r.on_metrics(_metrics(12, val_loss=3.0))  # a validation row off the checkpoint steps
    r.on_metrics(_metrics(15))
    r.on_event(CheckpointCommitted(save_s=0.1, step=15, path=_checkpoint(tmp_path, 15)))
    r.on_metrics(_metrics(20))
    r.on_end(None)  # the run ended before step 20's commit: the row still goes
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports][2:] == [
        (12, None), (15, 15), (20, None)]


def test_for_pbt_a_commit_written_before_its_row(tmp_path: Path, reports: list) -> None:
    """The controller handles a poll's commits before its rows: both orders pair up."""
    r = TuneReporter(STAGING, with_checkpoints=True)
    for step in (5, 10):
        r.on_event(CheckpointCommitted(save_s=0.1, step=step, path=_checkpoint(tmp_path, step)))
    r.on_metrics(_metrics(5))
    r.on_metrics(_metrics(10))
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports] == [(5, 5), (10, 10)]


def test_the_last_row_waits_for_the_final_checkpoint(tmp_path: Path, reports: list) -> None:
    """A scheduler may stop the trial at its last report (ASHA at max_t): the final
    checkpoint must come with that report, not after it."""
    r = TuneReporter(STAGING, final_step=20)
    r.on_metrics(_metrics(15))
    r.on_metrics(_metrics(20))
    assert [m["step"] for m, _ in reports] == [15]
    r.on_event(CheckpointCommitted(save_s=0.1, step=20, path=_checkpoint(tmp_path, 20)))
    assert [(m["step"], m.get("checkpoint_step")) for m, _ in reports] == [(15, None), (20, 20)]
    r.on_end(None)
    assert len(reports) == 2


def test_staging_copies_when_hard_links_cross_filesystems(tmp_path: Path, reports: list,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage on another filesystem than the trial: os.link fails with EXDEV, and staging
    copies the checkpoint instead (data first, manifest last, verified)."""
    import errno
    import os

    from stalwart.integrations.tune.reporter import stage

    path = _checkpoint(tmp_path / "storage", 20)

    def cross_device(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    monkeypatch.setattr(os, "link", cross_device)
    staged = stage(path, STAGING)
    assert staged is not None and staged == STAGING / "step_000000020"
    assert sorted(p.name for p in staged.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "manifest.json"]
    verify(read_step_dir(str(staged)), trust())
    assert (staged / "__0_0.distcp").stat().st_ino != (Path(path) / "__0_0.distcp").stat().st_ino


@pytest.mark.parametrize("name", ["../escaped", "/tmp/abs", "sub/dir", "..", "nul\0byte", ""])
def test_staging_and_copies_refuse_crafted_file_names(tmp_path: Path, name: str) -> None:
    """A manifest naming a file outside its directory is never followed by a copy."""
    import json

    from stalwart.integrations.tune.reporter import stage

    path = _checkpoint(tmp_path / "storage", 20)
    manifest_file = Path(path) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][name] = {"size": 4, "sha256": "0" * 64}
    manifest_file.write_text(json.dumps(manifest))
    (tmp_path / "storage" / "escaped").write_bytes(b"evil")
    assert stage(path, STAGING) is None
    assert not (STAGING / "escaped").exists()
    with pytest.raises(CheckpointError, match="is not a plain file name"):
        read_step_dir(path)
    with pytest.raises(CheckpointError, match="is not a plain file name"):
        copy_checkpoint(CheckpointInfo(step=20, path=path, manifest=manifest),
                        str(tmp_path / "dest"))
    assert not (tmp_path / "escaped").exists()
