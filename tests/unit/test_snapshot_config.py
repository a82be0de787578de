"""`checkpoint.snapshot_every = "auto"` and `checkpoint.snapshot_budget` as a user sets them:
TOML, --set, a dump that loads back, the errors that name the field and what it allows, the
check against fingerprints, and the memory tier the restore policy then asks."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import JobConfig, dump_config, load_config
from stalwart.core.errors import ConfigError
from stalwart.orchestrator.policies import default_policies

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

EVERY_ALLOWED = ('an integer >= 0 (0 turns the in-memory tier off) or "auto" (an interval '
                 "chosen to keep the tier's cost under snapshot_budget)")


def test_auto_from_the_command_line_and_from_toml(tmp_path: Path) -> None:
    config = load_config(None, ["checkpoint.snapshot_every=auto"])
    assert config.checkpoint.snapshot_every == "auto" and config.checkpoint.memory_tier
    assert config.checkpoint.snapshot_budget == 0.02
    path = tmp_path / "job.toml"
    path.write_text('[checkpoint]\nsnapshot_every = "auto"\nsnapshot_budget = 0.05\n')
    from_toml = load_config(path)
    assert (from_toml.checkpoint.snapshot_every, from_toml.checkpoint.snapshot_budget) == \
        ("auto", 0.05)
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_config(from_toml))
    assert load_config(dumped) == from_toml


def test_an_interval_is_still_an_integer_and_zero_turns_the_tier_off() -> None:
    assert load_config(None, ["checkpoint.snapshot_every=3"]).checkpoint.snapshot_every == 3
    off = load_config(None, ["checkpoint.snapshot_every=0"]).checkpoint
    assert not off.memory_tier
    assert JobConfig().checkpoint.snapshot_every == 1  # the default is unchanged


@pytest.mark.parametrize(("override", "expected"), [
    ("checkpoint.snapshot_every=sometimes",
     f"checkpoint.snapshot_every = 'sometimes' is invalid: {EVERY_ALLOWED}"),
    ('checkpoint.snapshot_every="AUTO"',
     f"checkpoint.snapshot_every = 'AUTO' is invalid: {EVERY_ALLOWED}"),
    ("checkpoint.snapshot_every=-1",
     f"checkpoint.snapshot_every = -1 is invalid: {EVERY_ALLOWED}"),
    ("checkpoint.snapshot_every=1.5",
     "checkpoint.snapshot_every = 1.5 is invalid: expected an int or a str"),
    ("checkpoint.snapshot_every=true",
     "checkpoint.snapshot_every = True is invalid: expected an int or a str"),
    ("checkpoint.snapshot_budget=0",
     "checkpoint.snapshot_budget = 0.0 is invalid: must be between 0 and 1, both excluded "
     "(a fraction of the step time: 0.02 is 2%)"),
    ("checkpoint.snapshot_budget=1",
     "checkpoint.snapshot_budget = 1.0 is invalid: must be between 0 and 1, both excluded "
     "(a fraction of the step time: 0.02 is 2%)"),
    ("checkpoint.snapshot_budget=nan",
     "checkpoint.snapshot_budget = nan is invalid: must be a finite number (not inf or nan)"),
    ("checkpoint.snapshot_budget=auto",
     "checkpoint.snapshot_budget = 'auto' is invalid: expected a float"),
])
def test_bad_values_name_the_field_and_what_is_allowed(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == expected


def test_fingerprints_refuse_an_auto_interval() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["checkpoint.snapshot_every=auto", "numerics.fingerprint_every=2"])
    assert str(err.value) == (
        'numerics.fingerprint_every = 2 is invalid: needs a snapshot every step, and '
        'checkpoint.snapshot_every = "auto" chooses its own interval: set '
        "checkpoint.snapshot_every = 1, or numerics.fingerprint_every = 0 (off)")


def test_an_auto_interval_has_a_memory_tier_to_restore_from() -> None:
    auto = load_config(None, ["checkpoint.snapshot_every=auto"])
    assert default_policies(auto, storage_url="file:///x").restore.memory_tier
    off = load_config(None, ["checkpoint.snapshot_every=0"])
    assert not default_policies(off, storage_url="file:///x").restore.memory_tier
