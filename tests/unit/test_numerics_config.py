"""The [numerics] section: its validation messages, the snapshots the memory tier keeps for
it, its --set overrides, and the numerical faults' --inject syntax."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stalwart.core.config import (
    CheckpointConfig,
    FaultKind,
    JobConfig,
    NumericsConfig,
    TrainConfig,
    dump_config,
    load_config,
    parse_fault,
)
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_defaults_check_nans_only() -> None:
    nc = load_config(None).numerics
    assert nc == NumericsConfig()
    assert nc.nan_check and nc.spike_z == 0 and nc.fingerprint_every == 0
    assert (nc.evict_after, nc.max_skips, nc.skip_steps) == (2, 3, [])


@pytest.mark.parametrize(("settings", "message"), [
    ({"spike_z": 0.5}, "numerics.spike_z = 0.5 is invalid: must be >= 1 (robust standard "
                       "deviations), or 0 (off)"),
    ({"spike_z": -1.0}, "numerics.spike_z = -1.0 is invalid: must be >= 1"),
    ({"spike_z": float("inf")}, "numerics.spike_z = inf is invalid: must be a finite number"),
    ({"spike_window": 4}, "numerics.spike_window = 4 is invalid: must be >= 5"),
    ({"spike_warmup": -1}, "numerics.spike_warmup = -1 is invalid: must be >= 0"),
    ({"fingerprint_every": -1}, "numerics.fingerprint_every = -1 is invalid: must be >= 0 "
                                "(0: off)"),
    ({"evict_after": 0}, "numerics.evict_after = 0 is invalid: must be >= 1"),
    ({"max_skips": -1}, "numerics.max_skips = -1 is invalid: must be >= 0"),
    ({"skip_steps": [3, 0]}, "numerics.skip_steps = [3, 0] is invalid: must be a list of "
                             "steps >= 1"),
])
def test_each_bad_value_names_its_key_and_what_is_allowed(settings: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        NumericsConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("settings", [
    {"spike_z": 0.0}, {"spike_z": 1.0}, {"spike_z": 8.0}, {"spike_window": 5},
    {"spike_warmup": 0}, {"fingerprint_every": 0}, {"fingerprint_every": 1},
    {"evict_after": 1}, {"max_skips": 0}, {"skip_steps": [1, 7]},
])
def test_the_bounds_themselves_are_allowed(settings: dict[str, object]) -> None:
    NumericsConfig(**settings)  # type: ignore[arg-type]


def test_skip_steps_past_the_run_are_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "numerics.skip_steps = [5, 11] is invalid: steps must be <= train.steps = 10")):
        JobConfig(train=TrainConfig(steps=10, warmup_steps=2), numerics=NumericsConfig(skip_steps=[5, 11]))
    JobConfig(train=TrainConfig(steps=10, warmup_steps=2), numerics=NumericsConfig(skip_steps=[10]))


@pytest.mark.parametrize("snapshot_every", [0, 2])
def test_fingerprints_need_a_snapshot_every_step(snapshot_every: int) -> None:
    with pytest.raises(ConfigError) as info:
        JobConfig(checkpoint=CheckpointConfig(snapshot_every=snapshot_every),
                  numerics=NumericsConfig(fingerprint_every=4))
    message = str(info.value)
    assert message.startswith("numerics.fingerprint_every = 4 is invalid: needs "
                              f"checkpoint.snapshot_every = 1 (it is {snapshot_every})")
    assert "or set it to 0 (off)" in message


def test_no_fingerprints_need_no_snapshots() -> None:
    JobConfig(checkpoint=CheckpointConfig(snapshot_every=0),
              numerics=NumericsConfig(fingerprint_every=0, spike_z=6.0))


@pytest.mark.parametrize(("every", "kept"), [(0, 2), (1, 2), (2, 3), (5, 6)])
def test_snapshots_kept_reach_back_past_the_last_matching_fingerprint(every: int,
                                                                      kept: int) -> None:
    assert NumericsConfig(fingerprint_every=every).snapshots_kept == kept


# ---------------------------------------------------------------------------- --set


def test_set_overrides_reach_the_section() -> None:
    config = load_config(None, ["numerics.spike_z=6", "numerics.fingerprint_every=2",
                                "numerics.skip_steps=[3, 5]", "numerics.nan_check=false"])
    nc = config.numerics
    assert nc.spike_z == 6.0 and isinstance(nc.spike_z, float)
    assert (nc.fingerprint_every, nc.skip_steps, nc.nan_check) == (2, [3, 5], False)
    assert config != load_config(None)
    assert config == load_config(None, ["numerics.spike_z=6.0", "numerics.fingerprint_every=2",
                                        "numerics.skip_steps=[3,5]", "numerics.nan_check=false"])


def test_the_section_survives_the_dump(tmp_path: Path) -> None:
    config = load_config(None, ["numerics.spike_z=7.5", "numerics.evict_after=3",
                                "numerics.skip_steps=[9]"])
    path = tmp_path / "job.toml"
    path.write_text(dump_config(config))
    assert load_config(path).numerics == config.numerics


@pytest.mark.parametrize(("override", "message"), [
    ("numerics.spike_z=0.5", "numerics.spike_z = 0.5 is invalid"),
    ("numerics.fingerprint_every=1.5", "numerics.fingerprint_every = 1.5 is invalid"),
    ("numerics.bogus=1", "unknown key numerics.bogus in [numerics]; allowed: nan_check, "
                         "spike_z"),
])
def test_bad_overrides_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


# ---------------------------------------------------------------------------- --inject


def test_numerical_faults_parse() -> None:
    nan = parse_fault("nan:rank=1,step=20")
    assert (nan.kind, nan.rank, nan.node, nan.step) == (FaultKind.NAN, 1, -1, 20)
    spike = parse_fault("spike:step=30")  # a bad batch: rank 0 is enough
    assert (spike.kind, spike.rank, spike.step) == (FaultKind.SPIKE, 0, 30)
    flip = parse_fault("bitflip:rank=1,step=40")
    assert (flip.kind, flip.rank, flip.step) == (FaultKind.BITFLIP, 1, 40)
    assert [str(f) for f in (nan, spike, flip)] == [
        "nan:rank=1,step=20", "spike:rank=0,step=30", "bitflip:rank=1,step=40"]


@pytest.mark.parametrize("text", ["nan:step=20", "bitflip:step=40"])
def test_nan_and_bitflip_need_a_rank(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("faults.rank = -1 is invalid")):
        parse_fault(text)


@pytest.mark.parametrize("text", ["nan:node=1,step=20", "spike:node=1,step=30"])
def test_numerical_faults_target_a_rank_not_a_node(text: str) -> None:
    with pytest.raises(ConfigError, match="targets a rank, not a node"):
        parse_fault(text)
