"""Fine-tuning a pretrained model as a user does it: a local Hugging Face model directory and a
JSONL of chat rows, `stalwart run` of a LoRA fine-tune under DDP with a worker killed
(recovered from memory, zero steps lost, the adapter equal bit for bit to a run without the
kill), its validation samples in the event log, the adapter exported for peft and merged for
transformers; a full fine-tune under FSDP2 exported with its tokenizer; and a resume onto
changed base weights refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.storage.catalog import find_step
from stalwart.checkpointing.storage.export import load_weights
from stalwart.core.events import read_jsonl
from tests.cli_helpers import sets, stalwart
from tests.keys import trust
from tests.pretrained import make_chat_data, make_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(500)]

pytest.importorskip("peft")

STEPS = 16
CONFIG = """\
[task]
path = "stalwart.tasks.hf:CausalLM"

[task.args]
model = "{model}"
data = "{data}"
seq_len = 64
lora = {{ r = 4, alpha = 8, target_modules = ["q_proj", "v_proj"] }}
sample_prompts = ["What is 3 + 4?"]
sample_tokens = 4

[scaling]
num_workers = 2

[parallel]
dp_replicate = -1
dp_shard = 1

[train]
steps = {steps}
global_batch_size = 8
micro_batch_size = 2
lr = 1e-2
warmup_steps = 2

[checkpoint]
persist_every = 8

[data]
val_every = 8
val_batches = 1
cache_dir = "{cache}"

[run]
progress = false
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune")
    base = make_model_dir(root / "base")
    shutil.copytree(base, root / "base-full")
    config = root / "finetune.toml"
    config.write_text(CONFIG.format(model=base, data=make_chat_data(root / "chat.jsonl"),
                                    steps=STEPS, cache=root / "cache"))
    common = ["failure.max_failures=1"]
    no_spare = "scaling.spare_workers=0"
    layouts = {
        "lora": [no_spare],
        "killed": [],
        "full": [no_spare, "parallel.dp_replicate=1", "parallel.dp_shard=-1",
                 f'task.args.model="{root / "base-full"}"', "task.args.lora=false",
                 "train.steps=4", "checkpoint.persist_every=4", "data.val_every=0",
                 "train.lr=1e-4"],
    }
    for name, layout in layouts.items():
        inject = ["--inject", "kill:rank=1,step=8"] if name == "killed" else []
        stalwart("run", str(config), *sets(*common, *layout), *inject,
                 "--run-dir", str(root / name), cwd=root, timeout=300)
    return {"root": root, "base": base, "config": config,
            **{name: root / name for name in layouts}}


def _weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_weights(find_step(str(run / "checkpoints"), step, trust()))


def test_a_killed_lora_worker_is_recovered_with_an_identical_adapter(runs) -> None:
    events = read_jsonl(runs["killed"] / "events.jsonl")
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["source"] == "memory" and recovered["lost_steps"] == 0
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == STEPS
    a, b = _weights(runs["lora"]), _weights(runs["killed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Only the adapters are in the checkpoint: 2 layers x (q, v) x (A, B).
    assert len(a) == 8 and all(".lora_" in k for k in a)
    metrics = read_jsonl(runs["lora"] / "metrics.jsonl")
    assert metrics[-1]["loss"] < metrics[0]["loss"] and "val_loss" in metrics[-1]


def test_validation_steps_write_the_model_s_samples(runs) -> None:
    events = read_jsonl(runs["lora"] / "events.jsonl")
    samples = [e for e in events if e["kind"] == "validation_samples"]
    assert [e["step"] for e in samples] == [8, STEPS]
    for event in samples:
        (sample,) = event["samples"]
        assert sample["prompt"] == "What is 3 + 4?" and isinstance(sample["text"], str)


def test_the_adapter_loads_in_peft_and_the_merged_model_in_transformers(runs, tmp_path,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    stalwart("export", str(runs["lora"]), "--format", "peft", "--out", str(adapter),
             cwd=tmp_path)
    stalwart("export", str(runs["lora"]), "--format", "hf", "--merge", "--out", str(merged),
             cwd=tmp_path)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base"]),
                                      adapter)
    trained = _weights(runs["lora"])
    for name, param in tuned.named_parameters():
        if ".lora_" in name:
            ours = name.removeprefix("base_model.model.")
            assert torch.equal(param, trained[ours]), name
    model = AutoModelForCausalLM.from_pretrained(merged)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**prompt).logits, tuned(**prompt).logits,
                                   atol=1e-4, rtol=0)
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 6


def test_a_full_fine_tune_exports_with_its_tokenizer(runs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "full"
    stalwart("export", str(runs["full"]), "--format", "hf", "--out", str(out), cwd=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template
    trained = _weights(runs["full"], 4)
    assert len(trained) > 8  # every weight trained, not adapters
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_a_resume_onto_changed_base_weights_is_refused(runs) -> None:
    make_model_dir(runs["root"] / "base-full", seed=1)  # same place, other weights
    proc = stalwart("run", str(runs["config"]), "--resume", "--run-dir", str(runs["full"]),
                    *sets("failure.max_failures=1", "scaling.spare_workers=0",
                          "parallel.dp_replicate=1", "parallel.dp_shard=-1",
                          f'task.args.model="{runs["root"] / "base-full"}"',
                          "task.args.lora=false", "train.steps=6",
                          "checkpoint.persist_every=4", "data.val_every=0", "train.lr=1e-4"),
                    cwd=runs["root"], check=2)
    assert "was trained on base model" in proc.stderr
    assert "whose weight files differ" in proc.stderr


def test_a_model_directory_without_config_fails_before_anything_starts(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    config = tmp_path / "finetune.toml"
    config.write_text(CONFIG.format(model=model, data=make_chat_data(tmp_path / "chat.jsonl", 4),
                                    steps=4, cache=tmp_path / "cache"))
    proc = stalwart("run", str(config), "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                    check=2)
    assert f"task.args.model: {model} has no config.json" in proc.stderr
    assert not (tmp_path / "run").exists()
