"""`stalwart status RUN_DIR` on synthetic run directories (stalwart/cli/run_status.py):
finished, stopped, failed, no end recorded, no checkpoint, a damaged or foreign checkpoint,
and bad input. The checkpoints are real signed manifests over stand-in files: status
verifies them and never loads them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.layout import MANIFEST, step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.cli.main import main
from stalwart.core import events as E
from stalwart.core.config import dump_config, load_config
from tests.keys import signing_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0 = 1_800_000_000.0
STEPS = 40


def make_run(tmp_path: Path, events: list[E.Event], *, rows_to: int = 0,
             checkpoints: tuple[int, ...] = (), run_id: str | None = None,
             overrides: tuple[str, ...] = ()) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_config(load_config(
        None, [f"train.steps={STEPS}", *overrides])))
    (run / "events.jsonl").write_text("".join(E.dumps(e) + "\n" for e in events))
    rows = [E.MetricsRow(step=s, loss=2.0, lr=1e-3, tokens_per_s=100.0, world_size=2,
                         samples_seen=8 * s, time=T0 + s) for s in range(1, rows_to + 1)]
    (run / "metrics.jsonl").write_text("".join(E.dumps(r) + "\n" for r in rows))
    if run_id is not None:
        (run / "run_id").write_text(run_id + "\n")
    for step in checkpoints:
        write_checkpoint(run / "checkpoints", step, run_id=run_id)
    return run


def write_checkpoint(storage: Path, step: int, *, run_id: str | None = None) -> Path:
    d = storage / step_dir_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"metadata of step %d" % step)
    (d / "__0_0.distcp").write_bytes(b"shard of step %d" % step)
    extra = {"world_size": 1, **({"run_id": run_id} if run_id else {})}
    write_manifest(str(storage), step, extra, ranks=1, key=signing_key())
    return d


def started(t: float = T0) -> E.Event:
    return E.Started(time=t, world_size=2, steps=STEPS, start_step=0, task="t:T")


def status(run: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["status", str(run), *flags])
    return code, capsys.readouterr().out


def continue_line(run: Path, *flags: str) -> str:
    return (f"  continue:   stalwart run {run}/config.toml --run-dir {run} "
            f"--auto-resume{''.join(' ' + f for f in flags)}")


def test_a_finished_run(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Finished(time=T0 + 50, step=STEPS, loss=0.5)],
                   rows_to=STEPS, checkpoints=(20, 40))
    code, out = status(run, capsys=capsys)
    lines = out.splitlines()
    assert code == 0
    assert lines[0] == f"run {run}: FINISHED"
    assert "  step:       40 of 40" in lines
    assert f"  checkpoint: step 40, verified: {run / 'checkpoints' / step_dir_name(40)}" \
        in lines
    assert not any("continue" in line for line in lines)


def test_a_stopped_run_names_the_command_that_continues_it(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=25)], rows_to=20,
                   checkpoints=(20, 25))
    code, out = status(run, capsys=capsys)
    assert code == 1
    assert out.splitlines()[0] == f"run {run}: STOPPED"
    assert "  step:       25 of 40" in out.splitlines()  # the stop's step, past the last row
    assert "  checkpoint: step 25, verified:" in out
    assert out.splitlines()[-1] == continue_line(run)


def test_a_failed_run_gives_its_reason(tmp_path, capsys) -> None:
    reason = ("not retried (user error): Traceback (most recent call last):\n"
              "  File \"task.py\", line 3, in loss\nValueError: bad batch\n")
    run = make_run(tmp_path, [started(), E.Failed(time=T0 + 30, reason=reason, step=17)],
                   rows_to=17, checkpoints=(10,))
    code, out = status(run, capsys=capsys)
    assert code == 1
    assert out.splitlines()[:3] == [
        f"run {run}: FAILED",
        "  reason:     not retried (user error): Traceback (most recent call last): ... "
        "ValueError: bad batch",
        "  step:       17 of 40"]
    assert out.splitlines()[-1] == continue_line(run)


def test_no_end_recorded_is_running_or_a_lost_driver(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.CheckpointCommitted(time=T0 + 11, step=10,
                                                               path="p", save_s=0.1)],
                   rows_to=13, checkpoints=(10,))
    code, out = status(run, capsys=capsys)
    lines = out.splitlines()
    assert code == 3
    assert lines[0] == f"run {run}: RUNNING, or its driver was lost (no end recorded)"
    assert "  step:       13 of 40" in lines  # the last metrics row
    assert lines[2].startswith("  last event: ") and "ago)" in lines[2]
    assert lines[-1] == continue_line(run).replace("continue:   ",
                                                   "continue:   if its driver is gone: ")


def test_a_resumed_run_is_running_again_after_its_stop(tmp_path, capsys) -> None:
    events = [started(), E.Stopped(time=T0 + 30, step=25),
              E.Resumed(time=T0 + 100, from_step=25, path="p"),
              E.Started(time=T0 + 101, world_size=2, steps=STEPS, start_step=25, task="t:T")]
    run = make_run(tmp_path, events, rows_to=20, checkpoints=(25,))
    code, out = status(run, capsys=capsys)
    assert code == 3 and "no end recorded" in out.splitlines()[0]


def test_a_run_started_again_without_a_checkpoint_is_running(tmp_path, capsys) -> None:
    # Stopped before its first checkpoint, then started afresh in the same run dir: no
    # `resumed` event, but a new `started`.
    events = [started(), E.Stopped(time=T0 + 3, step=2), started(T0 + 100)]
    code, out = status(make_run(tmp_path, events, rows_to=2), capsys=capsys)
    assert code == 3 and "no end recorded" in out.splitlines()[0]


def test_a_run_without_a_checkpoint(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 3, step=2)], rows_to=2)
    code, out = status(run, capsys=capsys)
    assert code == 1
    assert f"  checkpoint: none committed under {run / 'checkpoints'}" in out.splitlines()
    assert out.splitlines()[-1] == continue_line(run) + "  (no checkpoint yet: from step 0)"


def test_a_run_dir_with_no_event_yet(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [])
    code, out = status(run, capsys=capsys)
    assert code == 3
    assert "(no event yet: it is starting, or it was lost before its first event)" in out


def test_a_damaged_checkpoint_is_named_and_the_older_one_given(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(20, 30))
    (run / "checkpoints" / step_dir_name(30) / "__0_0.distcp").write_bytes(b"tampered")
    code, out = status(run, capsys=capsys)
    assert code == 1
    assert "  checkpoint: step 20, verified:" in out
    (skipped,) = [line for line in out.splitlines() if "not verified" in line]
    assert skipped.startswith("  not verified (never loaded): step 30: checkpoint ")
    assert "file __0_0.distcp is damaged" in skipped
    assert out.splitlines()[-1] == continue_line(run)


def test_when_no_checkpoint_verifies_there_is_nothing_to_continue_from(tmp_path,
                                                                       capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(30,))
    manifest = run / "checkpoints" / step_dir_name(30) / MANIFEST
    body = json.loads(manifest.read_text())
    del body["signature"], body["key_id"]  # as made elsewhere, or by someone without the key
    manifest.write_text(json.dumps(body))

    code, out = status(run, capsys=capsys)
    assert code == 1
    assert f"  checkpoint: none verifies under {run / 'checkpoints'}" in out
    assert "it is not signed; --trust-unsigned accepts it" in out
    assert out.splitlines()[-1] == ("  continue:   no checkpoint verifies (above); nothing "
                                    "to continue from")
    # With --trust-unsigned, as `run --trust-unsigned` would, and the command says so.
    code, out = status(run, "--trust-unsigned", capsys=capsys)
    assert "  checkpoint: step 30, verified (accepted although it is not signed):" in out
    assert out.splitlines()[-1] == continue_line(run, "--trust-unsigned")


def test_a_checkpoint_of_another_run_does_not_verify(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(30,), run_id="ours")
    write_checkpoint(run / "checkpoints", 35, run_id="theirs")
    _, out = status(run, capsys=capsys)
    assert "  checkpoint: step 30, verified:" in out
    assert "step 35: checkpoint" in out and "belongs to run 'theirs'" in out


def test_a_missing_key_says_the_checkpoints_cannot_be_verified(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(30,))
    code, out = status(run, "--key-file", f"{tmp_path}/nokey", capsys=capsys)
    assert code == 1
    assert (f"  checkpoint: unknown: they cannot be verified here: --key-file "
            f"'{tmp_path}/nokey' does not exist") in out
    assert not (tmp_path / "nokey").exists()  # read only: no key made up
    assert f"--auto-resume --key-file {tmp_path}/nokey" in out  # the run needs it too


def test_a_run_dir_cannot_name_the_key_or_a_web_address(tmp_path, capsys) -> None:
    """A copied run dir is data: a key file or an http:// storage in its config is
    never used, and is said so."""
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(30,))
    config = run / "config.toml"
    config.write_text(config.read_text().replace(
        "[checkpoint]\n", "[checkpoint]\nkey_file = \"/etc/os-release\"\n"))
    assert main(["status", str(run)]) == 2
    assert "checkpoint.key_file = '/etc/os-release' is no longer read" in capsys.readouterr().err
    (tmp_path / "web").mkdir()
    web = make_run(tmp_path / "web", [started()], overrides=(
        "checkpoint.storage=http://127.0.0.1:9/x",))
    assert main(["status", str(web)]) == 2
    assert "http:// is not read from a run directory's config" in capsys.readouterr().err
    assert main(["export", str(web), "--out", str(tmp_path / "w.pt")]) == 2
    assert "http:// is not read from a run directory's config" in capsys.readouterr().err


@pytest.mark.parametrize("make, expect", [
    (lambda p: (p.mkdir(), p)[1], "is a directory but not a run directory (it holds no "
                               "config.toml or events.jsonl); status takes a run directory "
                               "or a job id"),
    (lambda p: (p.write_text("x"), p)[1], "is a file; status takes a run directory or a job id"),
    (lambda p: p / "nowhere", "does not exist; status takes a run directory or a job id"),
], ids=["empty-dir", "file", "missing-path"])
def test_a_path_that_is_no_run_dir_is_one_error_line(tmp_path, capsys, make, expect) -> None:
    path = make(tmp_path / "x")
    assert main(["status", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("stalwart: error: ") and f"{path} {expect}" in line


def test_a_name_that_is_neither_a_run_dir_nor_a_reachable_job(tmp_path, capsys,
                                                               monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["status", "raysubmit_123"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("stalwart: error: no run directory 'raysubmit_123' here; as a "
                           "job id: no cluster given: pass --address")
    assert main(["status", "raysubmit_123", "--trust-unsigned"]) == 2
    assert "--trust-unsigned is for a run directory" in capsys.readouterr().err


def test_a_damaged_event_log_is_bad_input(tmp_path, capsys) -> None:
    run = make_run(tmp_path, [started()])
    with (run / "events.jsonl").open("a") as f:
        f.write("{not json\n" + E.dumps(E.Stopped(time=T0 + 3, step=2)) + "\n")
    assert main(["status", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("stalwart: error: ") and "events.jsonl line 2" in line


def test_status_of_a_run_dir_needs_neither_ray_nor_torch(tmp_path) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=T0 + 30, step=30)], rows_to=30,
                   checkpoints=(30,))
    code = ("import sys; from stalwart.cli.main import main; rc = main(['status', sys.argv[1]]);"
            "print([m for m in ('ray', 'torch') if m in sys.modules], rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.splitlines()[-1] == "[] 1"
