"""JobConfig: loading from TOML, --set overrides, validation messages, and the dump round trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from stalwart.core.config import JobConfig, dump_config, load_config
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"


def _write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------- loading


def test_defaults_load_without_a_file() -> None:
    config = load_config(None)
    assert config == JobConfig()
    assert config.task.path == "stalwart.examples.gpt.task:GPTTask"
    assert config.task.args == {}
    assert config.scaling.num_workers == 2
    assert (config.parallel.dp_replicate, config.parallel.dp_shard) == (1, -1)
    assert config.train.global_batch_size == 32 and config.train.micro_batch_size == 8
    assert config.grad_accum_steps == 2  # 32 / (8 x 2)
    assert config.checkpoint.storage == "" and config.checkpoint.keep_last == 3
    assert config.failure.max_failures == 0
    # elasticity is off unless asked for: the floor and the ceiling are num_workers
    assert (config.scaling.min_workers, config.scaling.max_workers) == (0, 0)
    assert (config.scaling.floor, config.scaling.ceiling) == (2, 2)
    assert config.scaling.spare_workers == 0
    assert config.scaling.resize_check_s == 10.0 and config.scaling.wait_for_workers_s == 300.0
    assert config.failure.retry_user_errors is False and config.failure.backoff_s == 0.0
    assert config.failure.hang_timeout_floor_s == 5.0 and config.failure.hang_factor == 10.0
    assert config.faults == ()


def test_toml_file_load(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[task]
path = "my.module:MyTask"

[task.args]
d_model = 96
name = "tiny"

[scaling]
num_workers = 4
cpus_per_worker = 2          # an int where a float is declared is accepted

[parallel]
dp_replicate = 2
dp_shard = 2

[train]
steps = 50
global_batch_size = 64
micro_batch_size = 4
lr = 1e-4
warmup_steps = 5

[run]
name = "exp"
progress = false
""")
    config = load_config(path)
    assert config.task.path == "my.module:MyTask"
    assert config.task.args == {"d_model": 96, "name": "tiny"}
    assert config.scaling.num_workers == 4
    assert config.scaling.cpus_per_worker == 2.0
    assert isinstance(config.scaling.cpus_per_worker, float)
    assert (config.parallel.dp_replicate, config.parallel.dp_shard) == (2, 2)
    assert config.train.steps == 50 and config.train.lr == 1e-4
    assert config.grad_accum_steps == 64 // (4 * 4)
    assert config.run.name == "exp" and config.run.progress is False
    # sections absent from the file keep their defaults
    assert config.checkpoint == JobConfig().checkpoint


def test_reference_config_loads() -> None:
    config = load_config(REFERENCE_CONFIG)
    assert config.task.path == "stalwart.examples.gpt.task:GPTTask"
    assert config.run.name == "gpt"
    assert load_config(REFERENCE_CONFIG, ["scaling.num_workers=1"]).scaling.num_workers == 1


@pytest.mark.parametrize(("override", "get", "expected"), [
    ("train.steps=100", lambda c: c.train.steps, 100),
    ("train.lr=1e-3", lambda c: c.train.lr, 1e-3),
    ("train.lr=0.5", lambda c: c.train.lr, 0.5),
    ("train.lr=2", lambda c: c.train.lr, 2.0),  # int accepted for a float field
    ("run.progress=false", lambda c: c.run.progress, False),
    ("checkpoint.async_save=true", lambda c: c.checkpoint.async_save, True),
    ("run.name=nightly", lambda c: c.run.name, "nightly"),  # bare word: a string
    ('run.name="quoted"', lambda c: c.run.name, "quoted"),
    ("checkpoint.storage=/mnt/ckpt/run1", lambda c: c.checkpoint.storage, "/mnt/ckpt/run1"),
    ("checkpoint.storage=s3://bucket/x", lambda c: c.checkpoint.storage, "s3://bucket/x"),
    ("scaling.placement_strategy=SPREAD", lambda c: c.scaling.placement_strategy, "SPREAD"),
    ("task.args.d_model=64", lambda c: c.task.args, {"d_model": 64}),
    (" train.seed = 7 ", lambda c: c.train.seed, 7),
])
def test_set_overrides(override: str, get, expected) -> None:
    value = get(load_config(None, [override]))
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_apply_on_top_of_file_and_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, '[task.args]\nd_model = 128\nn_layers = 4\n[train]\nsteps = 10\n')
    config = load_config(path, ["task.args.d_model=64", "train.steps=20", "train.steps=30"])
    assert config.task.args == {"d_model": 64, "n_layers": 4}  # the other arg is kept
    assert config.train.steps == 30  # the last --set wins


def test_overrides_do_not_mutate_the_loaded_data(tmp_path: Path) -> None:
    from stalwart.core.config import apply_overrides

    data = {"task": {"args": {"d_model": 128}}, "train": {"steps": 10}}
    out = apply_overrides(data, ["task.args.d_model=64", "train.steps=5"])
    assert out["task"]["args"]["d_model"] == 64 and out["train"]["steps"] == 5
    assert data == {"task": {"args": {"d_model": 128}}, "train": {"steps": 10}}


# ---------------------------------------------------------------------------- unknown keys, types


def test_unknown_top_level_key_names_it_and_lists_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["bogus=1"])
    msg = str(err.value)
    assert "unknown key bogus in the top level" in msg
    assert ("allowed: task, scaling, parallel, train, checkpoint, failure, data, run, "
            "numerics, faults") in msg


def test_unknown_key_in_a_section_names_it_and_lists_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.stepz=10"])
    msg = str(err.value)
    assert "unknown key train.stepz in [train]; did you mean train.steps? allowed:" in msg
    assert ("allowed: steps, global_batch_size, micro_batch_size, lr, min_lr_ratio, "
            "warmup_steps, weight_decay, grad_clip, seed") in msg


def test_unknown_key_in_a_toml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[checkpoint]\nkeep_lats = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key checkpoint\.keep_lats in \[checkpoint\]; "
                                          r"did you mean checkpoint\.keep_last\? "
                                          r"allowed: storage, persist_every, keep_last, keep_best, best_metric, best_mode, async_save"):
        load_config(path)


def test_unknown_section_from_a_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown key optimizer in the top level"):
        load_config(path)


@pytest.mark.parametrize(("override", "expected"), [
    ('train.steps="x"', "train.steps = 'x' is invalid: expected a int"),
    ("train.steps=1.5", "train.steps = 1.5 is invalid: expected a int"),
    ("train.steps=true", "train.steps = True is invalid: expected a int"),
    ("train.lr=fast", "train.lr = 'fast' is invalid: expected a float"),
    ("train.lr=true", "train.lr = True is invalid: expected a float"),
    ("run.progress=1", "run.progress = 1 is invalid: expected a bool"),
    ("failure.retry_user_errors=1", "failure.retry_user_errors = 1 is invalid: expected a bool"),
    ("scaling.min_workers=1.5", "scaling.min_workers = 1.5 is invalid: expected a int"),
    ("run.name=3", "run.name = 3 is invalid: expected a str"),
    ("task.args=3", "task.args = 3 is invalid: expected a dict"),
    ("train=3", "train must be a table ([train]), got 3"),
])
def test_wrong_types_name_the_field(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


# ---------------------------------------------------------------------------- __post_init__ rules


@pytest.mark.parametrize(("override", "expected"), [
    ("task.path=no_colon", "task.path = 'no_colon' is invalid: expected 'module:attribute'"),
    ('task.path=":Task"', "task.path = ':Task' is invalid"),
    ('task.path="mod:"', "task.path = 'mod:' is invalid"),
    ("scaling.num_workers=0", "scaling.num_workers = 0 is invalid: must be >= 1"),
    ("scaling.cpus_per_worker=0", "scaling.cpus_per_worker = 0.0 is invalid: must be >= 0.0001 "
                                  "(Ray's smallest unit)"),
    ("scaling.gpus_per_worker=-1", "scaling.gpus_per_worker = -1.0 is invalid: must be 0 (CPU "
                                   "workers) or >= 0.0001 (Ray's smallest unit)"),
    ("scaling.placement_strategy=RANDOM",
     "scaling.placement_strategy = 'RANDOM' is invalid: one of PACK, SPREAD"),
    # workers are placed one actor at a time: the placement-group gang strategies are gone
    ("scaling.placement_strategy=STRICT_SPREAD",
     "scaling.placement_strategy = 'STRICT_SPREAD' is invalid: one of PACK, SPREAD"),
    ("scaling.placement_strategy=STRICT_PACK",
     "scaling.placement_strategy = 'STRICT_PACK' is invalid: one of PACK, SPREAD"),
    ("scaling.start_timeout_s=0", "scaling.start_timeout_s = 0.0 is invalid: must be > 0"),
    ("scaling.min_workers=-1", "scaling.min_workers = -1 is invalid: must be between 1 and "
                               "scaling.num_workers = 2 (0: no shrinking)"),
    ("scaling.min_workers=3", "scaling.min_workers = 3 is invalid: must be between 1 and "
                              "scaling.num_workers = 2 (0: no shrinking)"),
    ("scaling.max_workers=1", "scaling.max_workers = 1 is invalid: must be >= "
                              "scaling.num_workers = 2 (0: no growing)"),
    ("scaling.max_workers=-1", "scaling.max_workers = -1 is invalid: must be >= "
                               "scaling.num_workers = 2 (0: no growing)"),
    ("scaling.spare_workers=-1", "scaling.spare_workers = -1 is invalid: must be >= 0"),
    ("scaling.resize_check_s=0", "scaling.resize_check_s = 0.0 is invalid: must be > 0"),
    ("scaling.wait_for_workers_s=-5",
     "scaling.wait_for_workers_s = -5.0 is invalid: must be > 0"),
    ("parallel.dp_replicate=0", "parallel.dp_replicate = 0 is invalid: must be >= 1"),
    ("parallel.dp_replicate=-2", "parallel.dp_replicate = -2 is invalid: must be >= 1, or -1"),
    ("parallel.dp_shard=0", "parallel.dp_shard = 0 is invalid: must be >= 1, or -1"),
    ("parallel.dp_shard=-2", "parallel.dp_shard = -2 is invalid"),
    ("train.steps=0", "train.steps = 0 is invalid: must be >= 1"),
    ("train.global_batch_size=0", "train.global_batch_size = 0 is invalid: must be >= 1"),
    ("train.micro_batch_size=0", "train.micro_batch_size = 0 is invalid: must be >= 1"),
    ("train.global_batch_size=12",
     "train.global_batch_size = 12 is invalid: must be a multiple of train.micro_batch_size (8)"),
    ("train.lr=0", "train.lr = 0.0 is invalid: must be > 0"),
    ("train.lr=-1e-3", "train.lr = -0.001 is invalid: must be > 0"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio = 1.5 is invalid: must be in [0, 1]"),
    ("train.min_lr_ratio=-0.1", "train.min_lr_ratio = -0.1 is invalid: must be in [0, 1]"),
    ("train.warmup_steps=-1", "train.warmup_steps = -1 is invalid: must be in [0, train.steps=200]"),
    ("train.warmup_steps=201",
     "train.warmup_steps = 201 is invalid: must be in [0, train.steps=200]"),
    ("train.weight_decay=-0.1", "train.weight_decay = -0.1 is invalid: must be >= 0"),
    ("train.grad_clip=-1", "train.grad_clip = -1.0 is invalid: must be >= 0"),
    ("train.seed=-1", "train.seed = -1 is invalid: must be >= 0"),
    ("checkpoint.persist_every=0", "checkpoint.persist_every = 0 is invalid: must be >= 1"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last = -1 is invalid: must be >= 0 (0 keeps all)"),
    ("failure.max_failures=-2",
     "failure.max_failures = -2 is invalid: must be >= 0, or -1 for no limit"),
    ("failure.backoff_s=-1", "failure.backoff_s = -1.0 is invalid: must be >= 0"),
    ("failure.hang_timeout_floor_s=0",
     "failure.hang_timeout_floor_s = 0.0 is invalid: must be > 0"),
    ("failure.hang_factor=-1", "failure.hang_factor = -1.0 is invalid: must be > 0"),
    ("failure.collective_timeout_s=0",
     "failure.collective_timeout_s = 0.0 is invalid: must be > 0"),
    ("data.val_every=-1", "data.val_every = -1 is invalid: must be >= 0"),
    ("data.val_batches=0", "data.val_batches = 0 is invalid: must be >= 1"),
    ('run.name=""', "run.name = '' is invalid: must be non-empty and contain no '/'"),
    ("run.name=a/b", "run.name = 'a/b' is invalid: must be non-empty and contain no '/'"),
    ("run.log_every=0", "run.log_every = 0 is invalid: must be >= 1"),
])
def test_field_rules_name_field_and_value(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


@pytest.mark.parametrize("override", [
    "train.warmup_steps=0", "train.warmup_steps=200", "train.min_lr_ratio=0",
    "train.min_lr_ratio=1", "train.grad_clip=0", "checkpoint.keep_last=0", "data.val_every=0",
    "scaling.gpus_per_worker=0", "parallel.dp_shard=2", "scaling.placement_strategy=SPREAD",
    "failure.max_failures=-1", "failure.backoff_s=0", "failure.retry_user_errors=true",
    "scaling.min_workers=0", "scaling.min_workers=1", "scaling.min_workers=2",
    "scaling.max_workers=0", "scaling.max_workers=2", "scaling.max_workers=4",
    "scaling.spare_workers=0", "scaling.spare_workers=3",
])
def test_boundary_values_are_accepted(override: str) -> None:
    load_config(None, [override])


# ---------------------------------------------------------------------------- cross-field rules


def test_global_batch_must_split_over_micro_batches_and_workers() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.global_batch_size=24"])  # a multiple of 8, not of 8 x 2
    assert str(err.value) == ("train.global_batch_size = 24 is invalid: must be a multiple of "
                              "micro_batch_size x data-parallel ranks = 8 x 2 = 16")
    with pytest.raises(ConfigError, match=r"= 8 x 3 = 24"):
        load_config(None, ["scaling.num_workers=3"])  # 32 is not a multiple of 24
    config = load_config(None, ["scaling.num_workers=4"])  # 32 = 8 x 4 x 1
    assert config.grad_accum_steps == 1


def test_every_world_between_the_floor_and_the_ceiling_must_split() -> None:
    # the floor and the ceiling are world sizes the run may take: they must split too
    with pytest.raises(ConfigError) as err:
        load_config(None, ["scaling.num_workers=4", "scaling.min_workers=3"])
    assert str(err.value) == ("train.global_batch_size = 32 is invalid: must be a multiple of "
                              "micro_batch_size x data-parallel ranks = 8 x 3 = 24")
    with pytest.raises(ConfigError, match=r"= 8 x 3 = 24$"):
        load_config(None, ["scaling.max_workers=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.tp = 2 is invalid: must divide the world "
                                          r"size 1$"):
        load_config(None, ["parallel.tp=2", "train.global_batch_size=16",
                           "scaling.min_workers=1"])
    config = load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2",
                                "scaling.max_workers=8", "train.global_batch_size=64"])
    assert (config.scaling.floor, config.scaling.ceiling) == (2, 8)
    assert config.grad_accum_steps == 64 // (8 * 4)  # of the configured world


def test_dp_replicate_must_divide_the_world() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.dp_replicate = 3 is invalid: must divide "
                                          r"(the world size |scaling\.num_workers=)2$"):
        load_config(None, ["parallel.dp_replicate=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.dp_shard = 3 is invalid: must divide "):
        load_config(None, ["parallel.dp_replicate=-1", "parallel.dp_shard=3"])


def test_dp_replicate_times_dp_shard_must_equal_the_world() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["scaling.num_workers=4", "parallel.dp_replicate=2",
                           "parallel.dp_shard=4"])
    assert re.match(r"parallel\.dp_shard = 4 is invalid: dp_replicate x dp_shard must equal "
                    r"the world size / \(tp x cp x pp\) = 4\b", str(err.value)), str(err.value)
    for layout in (["parallel.dp_replicate=2", "parallel.dp_shard=2"],
                   ["parallel.dp_replicate=2"], ["parallel.dp_replicate=-1",
                                                 "parallel.dp_shard=2"]):
        config = load_config(None, ["scaling.num_workers=4", *layout])
        assert config.parallel.degrees(4) == (2, 2)


def test_only_one_data_parallel_degree_may_be_inferred() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.dp_replicate = -1 is invalid: at most one "
                                          r"of dp_replicate and dp_shard may be -1"):
        load_config(None, ["parallel.dp_replicate=-1", "parallel.dp_shard=-1"])


# ---------------------------------------------------------------------------- files


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        load_config(missing)
    assert str(err.value) == (f"config file {str(missing)!r} does not exist "
                              f"(expected a TOML file)")


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)


@pytest.mark.parametrize("text", [
    "[train\nsteps = 3\n",
    "[train]\nsteps = \n",
    "[train]\nsteps = 1\nsteps = 2\n",
])
def test_malformed_toml(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"config file {str(path)!r} is not valid TOML: " in str(err.value)


def test_binary_file_is_not_valid_toml(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)


def test_dump_round_trip(tmp_path: Path) -> None:
    config = load_config(None, [
        "task.args.d_model=64", 'task.args.tag="x"', "scaling.num_workers=4",
        "scaling.cpus_per_worker=0.5", "parallel.dp_replicate=2", "parallel.dp_shard=2",
        "train.global_batch_size=64",
        "train.lr=1e-3", "checkpoint.storage=/tmp/somewhere", "checkpoint.keep_last=0",
        "failure.max_failures=3", "run.progress=false", "run.name=rt",
        # a fixed dp_replicate x dp_shard layout cannot change its world size
        "scaling.min_workers=4", "scaling.max_workers=4", "scaling.spare_workers=1",
        "scaling.resize_check_s=2.5", "scaling.wait_for_workers_s=60",
        "failure.retry_user_errors=true", "failure.backoff_s=0.5",
        "failure.hang_timeout_floor_s=1", "failure.hang_factor=4",
        'faults=[{kind="kill", rank=1, step=3}, {kind="drain", node=1, step=4}]',
    ])
    path = _write(tmp_path, dump_config(config), "dumped.toml")
    again = load_config(path)
    assert again == config
    assert dataclasses.asdict(again) == dataclasses.asdict(config)
    assert load_config(_write(tmp_path, dump_config(JobConfig()), "d.toml")) == JobConfig()
    reference = load_config(REFERENCE_CONFIG)
    assert load_config(_write(tmp_path, dump_config(reference), "r.toml")) == reference


# ---------------------------------------------------------------------------- --set syntax


@pytest.mark.parametrize("override", ["foo", "=3", "train.=3", ".steps=3", "train..steps=3"])
def test_bad_set_syntax(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == (f"--set {override!r} is invalid: expected section.key=value, "
                              f"e.g. --set train.steps=100")


def test_set_through_a_value_that_is_not_a_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"--set 'train\.steps\.x=1': steps is not a section"):
        load_config(path, ["train.steps.x=1"])


def test_cpu_offload_needs_gpu_workers() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.cpu_offload = True is invalid: needs GPU"):
        load_config(None, ["parallel.cpu_offload=true"])
    assert load_config(None, ["parallel.cpu_offload=true", "scaling.gpus_per_worker=1"]
                       ).parallel.cpu_offload


def test_tp_must_divide_the_world_and_leaves_the_rest_to_data_parallel() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.tp = 3 is invalid: must divide the world"):
        load_config(None, ["parallel.tp=3"])
    config = load_config(None, ["scaling.num_workers=4", "parallel.tp=2",
                                "train.global_batch_size=16"])
    assert config.parallel.degrees(4) == (1, 2) and config.dp_size == 2
    assert config.grad_accum_steps == 16 // (8 * 2)


def test_pipeline_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.pp = 3 is invalid: tp x cp x pp = 3 must divide"):
        load_config(None, ["parallel.pp=3"])
    with pytest.raises(ConfigError, match=r"^parallel\.pp_schedule = 'zb' is invalid: one of "):
        load_config(None, ["parallel.pp=2", "parallel.pp_schedule=zb"])
    # 2 ranks, pp=2: one data-parallel rank, 16 / 8 = 2 micro-batches >= pp: fine; 8 / 8 is not.
    assert load_config(None, ["parallel.pp=2", "train.global_batch_size=16"]).dp_size == 1
    with pytest.raises(ConfigError, match=r"needs at least pp micro-batches per step"):
        load_config(None, ["parallel.pp=2", "train.global_batch_size=8"])


def test_the_gpt_refuses_layouts_it_cannot_take() -> None:
    from stalwart.core.errors import TaskError
    from stalwart.core.task import build_task
    from stalwart.parallel.dims import ParallelDims

    path = "stalwart.examples.gpt.task:GPTTask"
    tied = build_task(path, {"n_layers": 4})
    with pytest.raises(TaskError, match=r"parallel\.pp = 2 needs task\.args\.tie_embeddings"):
        tied.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2))
    untied = build_task(path, {"n_layers": 2, "tie_embeddings": False})
    untied.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2))
    with pytest.raises(ConfigError, match=r"4 pipeline stages need at least as many blocks"):
        untied.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2,
                                         stages_per_rank=2))
    with pytest.raises(ConfigError, match=r"parallel\.tp = 3 is invalid: must divide the model's 4"):
        tied.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=3))


def test_zero_bubble_with_data_parallelism_is_refused_naming_the_alternative() -> None:
    from stalwart.core.task import build_task
    from stalwart.parallel.dims import ParallelDims

    task = build_task("stalwart.examples.gpt.task:GPTTask", {"n_layers": 4,
                                                             "tie_embeddings": False})
    for replicate, shard in ((2, 1), (1, 2)):
        dims = ParallelDims.from_config(load_config(None, [
            "parallel.pp=2", f"parallel.dp_replicate={replicate}", f"parallel.dp_shard={shard}",
            "parallel.pp_schedule=zero_bubble", "scaling.num_workers=4",
            "train.global_batch_size=32"]).parallel, 4)
        with pytest.raises(ConfigError, match=r"^parallel\.pp_schedule = zero_bubble is invalid "
                                              r"with 2 data-parallel ranks .*interleaved_1f1b"):
            task.check_layout(dims)
    # One data-parallel rank (pure pipeline) and the other schedules with replicas train.
    task.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2, stages_per_rank=2,
                                   pp_schedule="zero_bubble"))
    task.check_layout(ParallelDims(dp_replicate=2, dp_shard=1, tp=1, pp=2, stages_per_rank=2,
                                   pp_schedule="interleaved_1f1b"))
