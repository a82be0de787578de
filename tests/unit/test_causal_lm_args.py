"""CausalLM refuses bad input on the driver, before any worker starts: one clear error for a
model directory without config or weights, weights that do not fit the config, LoRA target
modules that match nothing, chat rows without their fields, a tokenizer without a chat
template, a sequence longer than the model's, a layout it cannot train, and a checkpoint
trained on other base weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stalwart.core.errors import TaskError
from stalwart.core.task import build_task
from stalwart.parallel.dims import ParallelDims
from tests.pretrained import make_chat_data, make_model_dir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PATH = "stalwart.tasks.hf:CausalLM"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_chat_data(tmp_path_factory.mktemp("data") / "chat.jsonl", 8)


def task(model, data, **args):
    return build_task(PATH, {"model": str(model), "data": str(data), "seq_len": 64, **args})


def copy_of(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "model"))


def test_a_good_model_and_data_are_accepted(base, data):
    t = task(base, data, lora={"r": 4, "target_modules": ["q_proj"]})
    assert t.packing == "pack" and t.lora.r == 4


def test_a_directory_without_config_is_refused(base, data, tmp_path):
    model = copy_of(base, tmp_path)
    (model / "config.json").unlink()
    with pytest.raises(TaskError, match="has no config.json"):
        task(model, data)


def test_a_directory_without_safetensors_is_refused(base, data, tmp_path):
    model = copy_of(base, tmp_path)
    for f in model.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(TaskError, match=r"has no \*.safetensors weights \(it has model.bin"):
        task(model, data)


def test_no_such_directory_is_refused(data, tmp_path):
    with pytest.raises(TaskError, match="no such directory"):
        task(tmp_path / "nowhere", data)


def test_weights_that_do_not_fit_the_config_are_refused(base, data, tmp_path):
    model = copy_of(base, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(TaskError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' .* has "
                                        r"shape \[128, 64\], but its config.json makes it "
                                        r"\[96, 64\]"):
        task(model, data)


def test_lora_targets_that_match_nothing_are_refused_naming_the_layers(base, data):
    with pytest.raises(TaskError, match=r"target_modules = \['qkv'\] match no layer.*q_proj"):
        task(base, data, lora={"target_modules": ["qkv"]})


@pytest.mark.parametrize(("lora", "message"), [
    ({"rank": 4}, "unknown key task.args.lora.rank; allowed: r, alpha"),
    ({"r": 0}, "task.args.lora.r = 0 is invalid"),
    ({"dropout": 1.5}, r"task.args.lora.dropout = 1.5 is invalid: a number in \[0, 1\)"),
    ({"target_modules": []}, "task.args.lora.target_modules = \\[\\] is invalid"),
])
def test_a_bad_lora_table_is_refused(base, data, lora, message):
    with pytest.raises(TaskError, match=message):
        task(base, data, lora=lora)


def test_chat_rows_without_their_fields_are_refused(base, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "hi", "answer": "hello"}) + "\n")
    with pytest.raises(TaskError, match="rows.jsonl:1"):
        task(base, rows)


def test_chat_rows_need_a_chat_template(base, data, tmp_path):
    model = copy_of(base, tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(TaskError, match="has no chat template"):
        task(model, data)


def test_a_sequence_longer_than_the_model_takes_is_refused(base, data):
    with pytest.raises(TaskError, match=r"seq_len = 4096 is above the model's maximum "
                                        r"\(max_position_embeddings = 256"):
        task(base, data, seq_len=4096)


def test_layouts_it_cannot_train_are_refused(base, data):
    lora = task(base, data, lora={"r": 4})
    with pytest.raises(TaskError, match="LoRA adapters are not split over tensor-parallel"):
        lora.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=2))
    with pytest.raises(TaskError, match="parallel.pp = 2: the model in .* ties its output "
                                        "head to its embedding"):
        lora.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2))
    with pytest.raises(TaskError, match=r"parallel.tp = 8 must divide the model's attention "
                                        r"heads \(4\) and key/value heads \(2\)"):
        task(base, data).check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=8))


def test_a_checkpoint_of_other_base_weights_is_refused_naming_both(base, data, tmp_path):
    from stalwart.core.config import load_config

    config = load_config(None, [f'data.cache_dir="{tmp_path / "cache"}"'])
    t = task(base, data, lora={"r": 4})
    identity = t.checkpoint_identity(config)
    t.check_checkpoint({"step": 8, **identity}, config)  # the same weights: accepted
    other = make_model_dir(tmp_path / "other", seed=1)
    recorded = task(other, data).checkpoint_identity(config)
    with pytest.raises(TaskError, match=rf"step 8 was trained on base model '{other}' "
                                        rf"\({other}\), but task.args.model is '{base}'"):
        t.check_checkpoint({"step": 8, **recorded}, config)


def test_a_hub_id_resolves_from_the_hub_cache(base, data, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded here
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(base, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    t = task("acme/tiny", data, hub_cache=str(tmp_path / "hub"))
    assert t.path == repo / "snapshots" / "abc123"


def test_a_hub_id_neither_cached_nor_reachable_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskError, match=r"'acme/missing' is no local directory, not in the "
                                        r"hub cache .* cannot be fetched"):
        task("acme/missing", data, hub_cache=str(tmp_path / "hub"))


def test_the_memory_plan_gives_frozen_weights_no_gradient_or_optimizer_state(base, data):
    from stalwart.plan.estimate import ModelShape, PlanLayout, estimate

    full = ModelShape.from_task(task(base, data), None)
    lora = ModelShape.from_task(task(base, data, lora={"r": 4, "target_modules": ["q_proj"]}),
                                None)
    assert full.trainable is None and 0 < lora.trainable < lora.n_params // 50
    layout = PlanLayout(dp_replicate=2, dp_shard=1)
    a, b = estimate(full, layout), estimate(lora, layout)
    assert a.params <= b.params < 1.05 * a.params  # the frozen base is held all the same
    assert b.optimizer * 50 < a.optimizer and b.grads * 50 < a.grads


@pytest.mark.parametrize(("args", "message"), [
    ({"seq_len": 1}, r"task.args.seq_len = 1 is invalid: an int >= 2"),
    ({"packing": "greedy"}, r"task.args.packing = 'greedy' is invalid: one of auto, pack"),
    ({"val_fraction": 1.0}, r"task.args.val_fraction = 1.0 is invalid"),
    ({"val_data": 3}, r"task.args.val_data = 3 is invalid"),
    ({"sample_prompts": "hi"}, r"task.args.sample_prompts = 'hi' is invalid: a list"),
    ({"sample_tokens": 0}, r"task.args.sample_tokens = 0 is invalid"),
    ({"tokenizer": "x"}, r"unknown key task.args.tokenizer for CausalLM; allowed: model"),
])
def test_a_bad_argument_is_named(base, data, args, message):
    with pytest.raises(TaskError, match=message):
        task(base, data, **args)
