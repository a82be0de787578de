"""The [run] keys of profiling and TensorBoard, and the --profile STEPS syntax: every bad value
is one error naming the key (or the flag), the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import dump_config, load_config, parse_profile_steps
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_both_are_off_by_default() -> None:
    run = load_config(None).run
    assert run.tensorboard is False
    assert run.profile_steps == [] and run.profile_window is None


@pytest.mark.parametrize(("value", "window"), [("[5]", (5, 5)), ("[5, 7]", (5, 7)),
                                                ("[1, 200]", (1, 200)), ("[]", None)])
def test_profile_steps_accepts_one_step_or_an_inclusive_range(value, window) -> None:
    assert load_config(None, [f"run.profile_steps={value}"]).run.profile_window == window


@pytest.mark.parametrize(("value", "message"), [
    ("[0]", r"run.profile_steps = \[0\] is invalid: \[\] \(off\), \[STEP\] or \[FIRST, LAST\]"),
    ("[7, 5]", r"run.profile_steps = \[7, 5\] is invalid: .* 1 <= FIRST <= LAST"),
    ("[1, 2, 3]", r"run.profile_steps = \[1, 2, 3\] is invalid"),
    ("[150, 201]", r"run.profile_steps = \[150, 201\] is invalid: steps must be <= "
                   r"train.steps = 200"),
    ("5", r"run.profile_steps = 5 is invalid: expected a list"),
    ('["5"]', r"run.profile_steps = \['5'\] is invalid: expected a list"),
    ("[true]", r"run.profile_steps = \[True\] is invalid: expected a list"),
])
def test_profile_steps_refuses(value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"run.profile_steps={value}"])


def test_profile_steps_past_a_shorter_run_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"steps must be <= train.steps = 12"):
        load_config(None, ["train.steps=12", "train.warmup_steps=2", "run.profile_steps=[12, 13]"])
    assert load_config(None, ["train.steps=12", "train.warmup_steps=2",
                              "run.profile_steps=[12]"]).run.profile_window == (12, 12)


def test_tensorboard_must_be_a_bool() -> None:
    assert load_config(None, ["run.tensorboard=true"]).run.tensorboard is True
    with pytest.raises(ConfigError, match=r"run.tensorboard = 'yes' is invalid: expected a bool"):
        load_config(None, ["run.tensorboard=yes"])


def test_both_round_trip_through_config_toml(tmp_path: Path) -> None:
    config = load_config(None, ["run.tensorboard=true", "run.profile_steps=[3, 4]"])
    path = tmp_path / "config.toml"
    path.write_text(dump_config(config))
    assert "tensorboard = true\nloggers = []\ndashboard = false\nprofile_steps = [\n    3,\n    4,\n]" in path.read_text()
    assert load_config(path) == config


@pytest.mark.parametrize(("text", "steps"), [("20", [20, 20]), ("20-22", [20, 22]),
                                             (" 3-3 ", [3, 3]), ("1", [1, 1])])
def test_profile_flag_parses_a_step_or_a_range(text, steps) -> None:
    assert parse_profile_steps(text) == steps


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected STEP or FIRST-LAST"), ("x", "expected STEP or FIRST-LAST"),
    ("20-", "expected STEP or FIRST-LAST"), ("-3", "expected STEP or FIRST-LAST"),
    ("2-3-4", "expected STEP or FIRST-LAST"), ("2.5", "expected STEP or FIRST-LAST"),
    ("２", "expected STEP or FIRST-LAST"), ("0", "steps count from 1"),
    ("22-20", "FIRST must be <= LAST"),
])
def test_profile_flag_refuses(text, message) -> None:
    with pytest.raises(ConfigError, match=rf"--profile {text!r} is invalid: .*{message}"):
        parse_profile_steps(text)
