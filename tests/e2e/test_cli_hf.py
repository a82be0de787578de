"""The Hugging Face example as a user runs it: a transformers Llama on a `datasets` dataset of
local text with a tokenizer trained here, under DDP with a killed worker (recovered from
memory, weights bit-identical to a run without the kill) and under FSDP2; then `stalwart
export --format hf` loaded back by transformers' own from_pretrained, which generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.storage.catalog import find_step
from stalwart.checkpointing.storage.export import load_weights
from stalwart.core.events import read_jsonl
from tests.cli_helpers import sets, stalwart
from tests.keys import trust

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

pytest.importorskip("transformers")
pytest.importorskip("datasets")

HF_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "hf" / "config.toml"
STEPS = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three runs sharing one data cache: DDP, DDP with rank 1 killed at step 10, FSDP2."""
    root = tmp_path_factory.mktemp("hf")
    common = [f"train.steps={STEPS}", "checkpoint.persist_every=12", "data.val_every=12",
              f"data.cache_dir={root / 'cache'}", "run.progress=false",
              "failure.max_failures=1", "task.args.text_glob=[a-m]*.py",
              "task.args.vocab_size=1024", "task.args.seq_len=64"]
    # The runs nothing fails start no warm spare; the killed one's spare replaces rank 1.
    no_spare = "scaling.spare_workers=0"
    layouts = {"ddp": [no_spare], "killed": [],
               "fsdp": [no_spare, "parallel.dp_replicate=1", "parallel.dp_shard=-1"]}
    out = {}
    for name, layout in layouts.items():
        inject = ["--inject", "kill:rank=1,step=10"] if name == "killed" else []
        stalwart("run", str(HF_CONFIG), *sets(*common, *layout), *inject,
                 "--run-dir", str(root / name), cwd=root, timeout=300)
        out[name] = root / name
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_weights(find_step(str(run / "checkpoints"), STEPS, trust()))


def test_a_killed_worker_is_recovered_with_identical_weights(runs) -> None:
    events = read_jsonl(runs["killed"] / "events.jsonl")
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["source"] == "memory" and recovered["lost_steps"] == 0
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == STEPS
    a, b = _weights(runs["ddp"]), _weights(runs["killed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_trains_the_same_model(runs) -> None:
    ddp = read_jsonl(runs["ddp"] / "metrics.jsonl")
    fsdp = read_jsonl(runs["fsdp"] / "metrics.jsonl")
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp]
    assert fsdp[-1]["loss"] == pytest.approx(ddp[-1]["loss"], abs=2e-3)
    assert fsdp[-1]["loss"] < fsdp[0]["loss"]
    assert "val_loss" in fsdp[-1]


def test_export_hf_loads_with_from_pretrained_and_generates(runs, tmp_path: Path,
                                                            monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    proc = stalwart("export", str(runs["fsdp"]), "--format", "hf", "--out", str(out),
                    "--max-shard-size", "200KB", cwd=tmp_path)
    assert f"exported step {STEPS}" in proc.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded past the size
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as embed_tokens

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    trained = _weights(runs["fsdp"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    prompt = tokenizer("import os\n", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(generated[0]), str)

    # An existing directory is never overwritten.
    again = stalwart("export", str(runs["fsdp"]), "--format", "hf", "--out", str(out),
                     cwd=tmp_path, check=2)
    assert "already exists; refusing to overwrite it" in again.stderr
