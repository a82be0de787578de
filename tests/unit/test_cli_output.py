"""What the CLI prints around a run: the one command that continues a run (the same after a
stop, for a job and in `status`), "did you mean" for a misspelled key or command, the progress
line and the closing summary with val_loss, the task's metrics and the throughput's unit, the
plain tables, and the sweep's table per round."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.job_submission import JobDetails, JobStatus

from stalwart.cli.continuing import continue_command, trust_flags
from stalwart.cli.job_commands import _describe, job_continue
from stalwart.cli.main import _continue, _parser, closing_summary, main
from stalwart.cli.run_status import describe, read_status
from stalwart.core import events as E
from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.progress import (
    ProgressDisplay,
    metrics_text,
    row_throughput_unit,
    task_metrics,
    throughput_unit,
)
from stalwart.tables import columns, key_values
from stalwart.trainer import RunResult
from stalwart.workers.reports import StepReport
from tests.unit.test_run_status import make_run, started

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ------------------------------------------------------------------ the continue command


def test_the_continue_command_quotes_for_a_shell_and_passes_the_trust_options() -> None:
    command = continue_command("runs/my run", flags=trust_flags(True, "k.key", ["old.key"]))
    assert command == ("stalwart run 'runs/my run/config.toml' --run-dir 'runs/my run' "
                       "--auto-resume --trust-unsigned --key-file k.key "
                       "--trusted-key-file old.key")
    assert shlex.split(command)[2:5] == ["runs/my run/config.toml", "--run-dir", "runs/my run"]
    assert continue_command(Path(".")) == "stalwart run config.toml --run-dir . --auto-resume"


def _status_line(run: Path, *flags: str) -> str:
    status = read_status(run, trust_unsigned="--trust-unsigned" in flags)
    [line] = [line for line in describe(str(run), status, flags=flags).splitlines()
              if "continue:" in line]
    return line.split("continue:", 1)[1].strip()


def test_run_stop_and_status_print_one_and_the_same_command(tmp_path: Path) -> None:
    run = make_run(tmp_path, [started(), E.Stopped(time=2e9, step=25)], rows_to=20,
                   checkpoints=(25,))
    # `stalwart run`, stopped: as it was typed, with --set, --inject and --trust-unsigned.
    args = _parser().parse_args(["run", "cfg.toml", "--set", "train.lr=0.1", "--inject",
                                 "kill:rank=1,step=30", "--run-dir", str(run),
                                 "--trust-unsigned"])
    after_stop = _continue(args, run)
    # `stalwart stop JOB` and `stalwart status JOB`, for the job that ran it.
    job = JobDetails(type="SUBMISSION", submission_id="j1", status=JobStatus.STOPPED,
                     entrypoint=f"stalwart run cfg.toml --run-dir {run} --trust-unsigned "
                                f"--address auto", metadata={"stalwart_run_dir": str(run)})
    described = [line for line in _describe(job).splitlines() if "continue:" in line]
    assert after_stop == job_continue(job) == _status_line(run, "--trust-unsigned")
    assert described == [f"  continue:   {after_stop}"]
    assert after_stop == continue_command(run, flags=["--trust-unsigned"])


def test_a_job_submit_did_not_start_has_no_continue_command() -> None:
    job = JobDetails(type="SUBMISSION", submission_id="j2", status=JobStatus.FAILED,
                     entrypoint="python train.py")
    assert job_continue(job) is None and "continue" not in _describe(job)


def test_the_run_dir_config_continues_the_run_as_it_was_configured(tmp_path: Path) -> None:
    # The command reads the run dir's config.toml: the run's --set values are in it.
    run = make_run(tmp_path, [started(), E.Stopped(time=2e9, step=25)],
                   checkpoints=(25,), overrides=("train.lr=0.05",))
    config = shlex.split(_status_line(run))[2]
    assert load_config(config).train.lr == 0.05


# ------------------------------------------------------------------------ did you mean


def test_a_misspelled_config_key_names_the_one_meant() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.stesp=10"])
    assert str(err.value).startswith("unknown key train.stesp in [train]; did you mean "
                                     "train.steps? allowed: steps, ")
    with pytest.raises(ConfigError, match=r"unknown key chekpoint in the top level; did you "
                                          r"mean checkpoint\? allowed: task,"):
        load_config(None, ["chekpoint.keep_last=1"])
    with pytest.raises(ConfigError, match=r"unknown key zzz in the top level; allowed: "):
        load_config(None, ["zzz=1"])  # nothing close: no guess


def test_a_misspelled_command_or_choice_names_the_one_meant(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["stauts", "runs/x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: argument COMMAND: invalid choice: 'stauts'; did "
                          "you mean 'status'? choose from 'run', ")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["export", "runs/x", "--out", "y", "--format", "pfet"])
    assert "invalid choice: 'pfet'; did you mean 'peft'? choose from" in capsys.readouterr().err


# ---------------------------------------------------------------- progress and summary


def test_the_unit_is_samples_when_count_tokens_counts_one_per_sample() -> None:
    assert throughput_unit(64, 64.0) == "samples"  # a regression's [B, 1] targets
    assert throughput_unit(64 * 128, 64.0) == "tokens"  # a language model's [B, T]
    assert throughput_unit(None, 64.0) == throughput_unit(64, None) == "tokens"
    row = E.MetricsRow(step=10, loss=1.0, lr=1e-3, tokens_per_s=640.0 / 0.3, world_size=2,
                       samples_seen=640, time=0.0, window_s=0.3, steps_in_window=10)
    assert row_throughput_unit(row.to_row()) == "samples"
    assert row_throughput_unit(dataclasses.replace(row, samples_seen=80).to_row()) == "tokens"


def test_task_metrics_leave_out_the_columns_every_row_has() -> None:
    row = E.MetricsRow(step=10, loss=1.0, lr=1e-3, tokens_per_s=1.0, world_size=2,
                       samples_seen=80, time=0.0, val_loss=2.0, data_wait_s=0.1,
                       task_metrics={"mae": 0.25, "val_mae": 0.5}).to_row()
    assert task_metrics(row) == {"mae": 0.25, "val_mae": 0.5}
    assert metrics_text({"loss": 1.0, "val_loss": 2.0, "mae": 0.123456}) == (
        "loss 1.0000  val_loss 2.0000  mae 0.1235")


def _report(step: int, *, tokens: int, val_loss: float | None = None,
            metrics: dict[str, float] | None = None) -> StepReport:
    return StepReport(rank=0, step=step, loss=0.5, lr=1e-3, tokens=tokens, step_time_s=0.1,
                      time=float(step), val_loss=val_loss, samples_seen=64 * step,
                      metrics=metrics or {})


def test_the_plain_progress_line_shows_val_loss_task_metrics_and_the_unit(capsys) -> None:
    display = ProgressDisplay(total_steps=100, start_step=0, log_every=10, live=False)
    display.update(_report(9, tokens=64), None)  # not a logged step: no line
    display.update(_report(10, tokens=64, val_loss=0.75, metrics={"mae": 0.2, "val_mae": 0.3}),
                   1280.0)
    display.close()
    assert capsys.readouterr().err == ("step 10/100  loss 0.5000  val_loss 0.7500  val_mae 0.3"
                                       "  mae 0.2  lr 1.00e-03  1,280 samples/s\n")
    tokens = ProgressDisplay(total_steps=100, start_step=0, log_every=10, live=False)
    tokens.update(_report(10, tokens=64 * 128), 1e6)
    assert capsys.readouterr().err.endswith("lr 1.00e-03  1,000,000 tokens/s\n")


def test_a_display_whose_reader_went_away_goes_quiet(monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    display = ProgressDisplay(total_steps=100, start_step=0, log_every=10, live=False)
    monkeypatch.setattr("builtins.print", broken)
    display.update(_report(10, tokens=64), 1.0)  # no error: the run goes on
    display.update(_report(20, tokens=64), 1.0)
    display.log("a message")


def test_the_live_bar_holds_the_last_validation(capsys) -> None:
    display = ProgressDisplay(total_steps=30, start_step=0, log_every=10, live=True)
    display.update(_report(10, tokens=64, val_loss=0.75, metrics={"val_mae": 0.3}), 10.0)
    display.update(_report(11, tokens=64, metrics={"mae": 0.2}), None)
    fields = display._progress.tasks[0].fields
    display.close()
    assert fields["metrics"] == "val_loss 0.7500  val_mae 0.3  mae 0.2"
    assert fields["tps"] == "10 samples/s"


def test_the_closing_summary_shows_val_loss_task_metrics_and_the_unit(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text("")
    row = E.MetricsRow(step=300, loss=0.01, lr=1e-4, tokens_per_s=3200.0, world_size=2,
                       samples_seen=300 * 64, time=0.0, window_s=1.0, steps_in_window=50,
                       task_metrics={"mae": 0.08})
    result = RunResult(run_dir=tmp_path, state="FINISHED", step=300, loss=0.01, val_loss=0.02,
                       wall_s=12.5, tokens_per_s=3200.0,
                       metrics={"val_mae": 0.09, **row.to_row()})
    assert closing_summary(result).splitlines()[:3] == [
        "FINISHED at step 300 in 12.5s",
        "  loss 0.0100  val_loss 0.0200  val_mae 0.09  mae 0.08",
        "  throughput 3,200 samples/s"]


# ---------------------------------------------------------------------------- tables


def test_tables_are_plain_unwrapped_text_with_literal_cells() -> None:
    long = "/a/" + "x" * 300 + "/[bold]run"
    assert key_values([("run", long), ("goodput", "0.5")]) == f"run      {long}\ngoodput  0.5"
    assert columns(["trial", "lr"], [["t1", "0.01"], ["t22", "-"]], indent=2) == (
        "  trial  lr\n  t1     0.01\n  t22    -")


# --------------------------------------------------------------------------- sweeps


def _trial(trial_id: str, status: str, lr: float, step: int | None = None,
           best: float | None = None) -> SimpleNamespace:
    analysis = {} if step is None else {"step": {"last": step}, "loss": {"min": best}}
    return SimpleNamespace(trial_id=trial_id, status=status, config={"train.lr": lr},
                           metric_analysis=analysis)


def test_a_sweep_prints_one_compact_table_per_round(capsys) -> None:
    from stalwart.integrations.tune.rounds import RoundTable

    table = RoundTable(search=["train.lr"], metric="loss", mode="min", steps=20)
    trials = [_trial("b_00001", "TERMINATED", 1e-5, 5, 5.41),
              _trial("a_00000", "TERMINATED", 1e-2, 20, 3.09),
              _trial("c_00002", "RUNNING", 1e-3), _trial("d_00003", "ERROR", 0.1, 2, 7.0),
              _trial("e_00004", "PENDING", 1e-4)]
    table.on_step_end(iteration=1, trials=trials)
    assert capsys.readouterr().out == ""  # nothing changed: no table
    table.on_trial_complete(iteration=2, trials=trials, trial=trials[0])
    table.on_trial_start(iteration=2, trials=trials, trial=trials[2])
    table.on_step_end(iteration=2, trials=trials)
    assert capsys.readouterr().out == (
        "trials: 1 finished, 1 stopped early, 1 error, 1 running, 1 pending\n"
        "  trial    state          train.lr  step  best loss\n"
        "  a_00000  finished       0.01      20    3.09\n"
        "  b_00001  stopped early  1e-05     5     5.41\n"
        "  c_00002  running        0.001     -     -\n"
        "  d_00003  error          0.1       2     7\n"
        "  e_00004  pending        0.0001    -     -\n")
    table.on_step_end(iteration=3, trials=trials)
    assert capsys.readouterr().out == ""  # once per round
