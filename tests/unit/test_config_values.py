"""Rules by kind of value, for every field of every section: floats are finite, durations
bounded, integers 64-bit, strings free of NUL; [[faults]] tables with a missing key.

The fields are found from the dataclasses, so a field added later is covered too.
"""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from stalwart.core.config import FaultSpec, JobConfig, config_from_dict, load_config
from stalwart.core.config.sections import (
    MAX_DURATION_S,
    MAX_MEMORY_LIMIT_GB,
    MAX_RESOURCE_PER_WORKER,
    MAX_RUN_NAME_BYTES,
    MAX_WORKERS,
)
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _fields(kind: type) -> list[tuple[str, str]]:
    """(section, key) of every field of type `kind` in every section of a JobConfig."""
    out = []
    hints = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        cls = hints[section.name]
        if typing.get_origin(cls) is tuple:
            cls = FaultSpec
        for key, hint in typing.get_type_hints(cls).items():
            if hint is kind:
                out.append((section.name, key))
    return out


FLOATS = [f for f in _fields(float) if f[0] != "faults"]  # an array: --inject
INTS = [f for f in _fields(int) if f[0] != "faults"]
STRINGS = [f for f in _fields(str) if f[0] != "faults"]


def test_the_fields_are_found() -> None:
    # The keys users set most, and a few more: the walk finds every section's fields.
    for key in [("train", "lr"), ("train", "weight_decay"), ("scaling", "cpus_per_worker"),
                ("scaling", "gpus_per_worker"), ("failure", "hang_timeout_floor_s"),
                ("failure", "hang_factor"), ("checkpoint", "memory_limit_gb"),
                ("failure", "collective_timeout_s")]:
        assert key in FLOATS
    assert ("train", "steps") in INTS and ("run", "name") in STRINGS
    assert len(FLOATS) >= 15


@pytest.mark.parametrize("literal", ["inf", "+inf", "-inf", "nan", "-nan"])
@pytest.mark.parametrize(("section", "key"), FLOATS)
def test_every_float_key_refuses_non_finite_values(section: str, key: str, literal: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{section}.{key}={literal}"])
    value = float(literal)
    assert str(err.value) == (f"{section}.{key} = {value!r} is invalid: must be a finite "
                              f"number (not inf or nan)")


@pytest.mark.parametrize(("section", "key"), FLOATS)
def test_toml_inf_and_nan_literals_are_refused_from_a_file(tmp_path, section, key) -> None:
    for literal in ("inf", "nan"):
        path = tmp_path / "c.toml"
        path.write_text(f"[{section}]\n{key} = {literal}\n")
        with pytest.raises(ConfigError, match=rf"^{section}\.{key} = {literal} is invalid: "
                                              r"must be a finite number"):
            load_config(path)


def test_the_rule_holds_for_sections_built_in_python() -> None:
    from stalwart.core.config import FailureConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"^train\.lr = inf is invalid"):
        TrainConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match=r"^failure\.hang_factor = nan is invalid"):
        FailureConfig(hang_factor=float("nan"))
    with pytest.raises(ConfigError, match=r"^faults\.mbps = inf is invalid"):  # --inject's
        FaultSpec(kind="slow-link", rank=1, step=2, mbps=float("inf"))


@pytest.mark.parametrize(("section", "key"), [f for f in FLOATS if f[1].endswith("_s")])
def test_durations_are_bounded(section: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.{key} = 1e\+300 is invalid: a duration "
                                          rf"must be at most 1e\+09 s"):
        load_config(None, [f"{section}.{key}=1e300"])
    assert getattr(getattr(load_config(None, [f"{section}.{key}={MAX_DURATION_S}"]), section),
                   key) == MAX_DURATION_S


def test_an_integer_too_large_for_a_float_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^train\.lr = 1000+ is invalid: too large for a float"):
        load_config(None, ["train.lr=1" + "0" * 400])


@pytest.mark.parametrize(("section", "key"), INTS)
def test_every_int_key_must_fit_in_64_bits(section: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.{key} = {2**64} is invalid: must fit "
                                          r"in 64 bits"):
        load_config(None, [f"{section}.{key}={2**64}"])


@pytest.mark.parametrize(("section", "key"), STRINGS)
def test_every_string_key_refuses_nul(tmp_path, section: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[{section}]\n{key} = "a\\u0000b"\n')
    with pytest.raises(ConfigError, match=rf"^{section}\.{key} = 'a\\x00b' is invalid: must not "
                                          r"contain a NUL character"):
        load_config(path)


def test_ray_resource_precision() -> None:
    for key in ("cpus_per_worker", "gpus_per_worker"):
        with pytest.raises(ConfigError, match=rf"scaling\.{key} = 1e-05 is invalid: must be .*"
                                              r">= 0.0001 \(Ray's smallest unit\)"):
            load_config(None, [f"scaling.{key}=0.00001"])
    assert load_config(None, ["scaling.cpus_per_worker=0.0001"]).scaling.cpus_per_worker == 1e-4


@pytest.mark.parametrize(("table", "missing"), [
    ({"kind": "kill", "rank": 1}, "step"),
    ({"step": 3, "rank": 1}, "kind"),
    ({}, "kind"),
])
def test_a_faults_table_without_a_required_key(table, missing) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"faults": [table]})
    assert str(err.value) == (f"[[faults]] table {table!r} has no key {missing}; required: "
                              f"kind, step")


def test_good_values_still_load() -> None:
    config = load_config(None, ["train.lr=1e-3", "failure.hang_factor=4", "run.name=ok",
                                "train.seed=9223372036854775807"])
    assert config.train.lr == 1e-3 and config.train.seed == 2**63 - 1


def test_keep_best_ranks_by_a_metric_its_checkpoints_have() -> None:
    good = load_config(None, ["checkpoint.keep_best=2", "checkpoint.best_metric=val_accuracy",
                              "checkpoint.best_mode=max"])
    assert (good.checkpoint.keep_best, good.checkpoint.best_mode) == (2, "max")
    for overrides, fragment in [
        (["checkpoint.best_metric=tokens_per_s"], "checkpoint.best_metric = 'tokens_per_s'"),
        (["checkpoint.best_mode=lowest"], "min or max"),
        (["checkpoint.keep_best=-1"], "must be >= 0"),
        (["checkpoint.keep_best=1", "data.val_every=0"], "is never measured"),
        (["checkpoint.keep_best=1", "data.val_every=30", "train.steps=120"],
         "first meet at step 150, not before train.steps = 120"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            load_config(None, overrides)
    # by the training loss every checkpoint has a value: no validation needed
    load_config(None, ["checkpoint.keep_best=1", "checkpoint.best_metric=loss",
                       "data.val_every=0"])


@pytest.mark.parametrize("key", ["cpus_per_worker", "gpus_per_worker"])
def test_a_worker_reserves_at_most_1024_cpus_or_gpus(key: str) -> None:
    # 1e308 passed every check until Ray overflowed its fixed-point count, after the start.
    for value in ("1e308", "1025"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"scaling.{key}={value}"])
        assert str(err.value) == (f"scaling.{key} = {float(value)!r} is invalid: must be at "
                                  f"most {MAX_RESOURCE_PER_WORKER}: a worker is one process on "
                                  f"one node, and no node has more")
    config = load_config(None, [f"scaling.{key}={MAX_RESOURCE_PER_WORKER}"])
    assert getattr(config.scaling, key) == MAX_RESOURCE_PER_WORKER


@pytest.mark.parametrize("key", ["num_workers", "max_workers", "spare_workers"])
def test_a_count_of_workers_past_any_cluster_is_refused(key: str) -> None:
    # 10**12 spares went on to Ray as the CPUs of the local Ray, and failed there.
    with pytest.raises(ConfigError, match=rf"scaling.{key} = {10**12} is invalid: must be at "
                                          rf"most {MAX_WORKERS}"):
        load_config(None, [f"scaling.{key}={10**12}"])


def test_the_memory_tier_limit_is_at_most_1_pib() -> None:
    # A worker turns it into bytes: 1e308 GiB overflowed there, at the first snapshot.
    with pytest.raises(ConfigError, match=r"^checkpoint\.memory_limit_gb = 1e\+308 is invalid: "
                                          r"must be at most 1048576 \(1 PiB per worker\)"):
        load_config(None, ["checkpoint.memory_limit_gb=1e308"])
    assert load_config(None, ["checkpoint.memory_limit_gb=1048576"]).checkpoint.memory_limit_gb \
        == MAX_MEMORY_LIMIT_GB


@pytest.mark.parametrize(("name", "size"), [("a" * 201, 201), ("é" * 101, 202),
                                            ("a" * 300, 300)])
def test_a_run_name_fits_a_file_name_with_its_timestamp(name: str, size: int) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f'run.name="{name}"'])
    assert str(err.value) == (f"run.name = {name!r} is invalid: must be at most "
                              f"{MAX_RUN_NAME_BYTES} bytes in UTF-8, not {size} (the run dir "
                              f"runs/<name>-<timestamp> must fit in a 255-byte file name)")


def test_the_longest_run_name_makes_a_valid_run_dir(tmp_path) -> None:
    from stalwart.run_dir import RunDir

    for name in ("a" * MAX_RUN_NAME_BYTES, "é" * (MAX_RUN_NAME_BYTES // 2)):
        config = load_config(None, [f'run.name="{name}"'])
        path = tmp_path / RunDir.default_path(config)
        path.mkdir(parents=True)  # one file name component: the OS takes it
        assert len(path.name.encode()) == MAX_RUN_NAME_BYTES + len("-YYYYmmdd-HHMMSS") < 255


@pytest.mark.parametrize("value", ["", " ", "\t \n"])
def test_the_data_cache_dir_names_a_directory(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.cache_dir={value!r}".replace("'", '"')])
    assert str(err.value) == (f"data.cache_dir = {value!r} is invalid: must name a directory; "
                              f"leave it unset for the default (~/.cache/stalwart)")
    assert load_config(None, ['data.cache_dir="./cache"']).data.cache_dir == "./cache"
