"""The LoRA exporter against peft itself: the adapter under peft's saved names gives the
injected model's logits once PeftModel loads it, the merge equals peft's merge_and_unload
(tied and untied embeddings, rsLoRA, rank and alpha patterns, fan_in_fan_out), and from a
signed checkpoint both formats load back; a changed base model and unsupported adapters are
refused by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import find_step
from stalwart.checkpointing.storage.export import export_newest
from stalwart.checkpointing.storage.export_hf import SINGLE, check_out_dir, write_hf
from stalwart.checkpointing.storage.export_peft import (
    ADAPTER_WEIGHTS,
    base_model_files,
    check_supported,
    lora_pairs,
    merge_lora,
    peft_state_dict,
    read_base_weights,
    scaling,
    write_merged,
    write_peft,
)
from tests.keys import trust
from tests.lora_checkpoints import (
    LoraModel,
    base_model_entry,
    commit_checkpoint,
    lora_checkpoint,
    lora_model,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 2, 33, 7, 60, 4]])
VARIANTS = {"plain": {}, "rslora": {"use_rslora": True},
            "patterns": {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 16}}}


def _fresh_base(lm: LoraModel) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(lm.base).eval()


def _adapter_dir(lm: LoraModel, where: Path) -> Path:
    """What write_peft writes, from the pure parts: peft's names and the config as is."""
    from safetensors.torch import save_file

    where.mkdir()
    (where / "adapter_config.json").write_bytes(lm.adapter_config)
    save_file(peft_state_dict(lm.lora), str(where / ADAPTER_WEIGHTS))
    return where


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_peft_names_are_the_ones_peft_saves(tmp_path: Path) -> None:
    lm = lora_model(tmp_path, tied=False)
    config = peft.LoraConfig.from_pretrained(str(_adapter_dir(lm, tmp_path / "ours")))
    wrapped = peft.get_peft_model(_fresh_base(lm), config)
    assert set(peft.get_peft_model_state_dict(wrapped)) == set(peft_state_dict(lm.lora))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in \
        peft_state_dict(lm.lora)


@pytest.mark.parametrize("tied", [True, False])
def test_the_adapter_loaded_by_peft_gives_the_injected_models_logits(tmp_path: Path,
                                                                     tied: bool) -> None:
    lm = lora_model(tmp_path, tied=tied)
    loaded = peft.PeftModel.from_pretrained(_fresh_base(lm), _adapter_dir(lm, tmp_path / "a"))
    expected = _logits(lm.model)
    assert not torch.allclose(expected, _logits(_fresh_base(lm)), atol=1e-3)  # LoRA matters
    torch.testing.assert_close(_logits(loaded.eval()), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tied", [True, False])
def test_the_merge_is_peft_merge_and_unload(tmp_path: Path, tied: bool, variant: str) -> None:
    lm = lora_model(tmp_path, tied=tied, **VARIANTS[variant])
    base = read_base_weights([lm.base / SINGLE])
    merged = merge_lora(base, lm.lora, json.loads(lm.adapter_config))
    assert merged.keys() == base.keys()
    assert ("lm_head.weight" in merged) is not tied  # the base files' own naming
    reference = peft.PeftModel.from_pretrained(
        _fresh_base(lm), _adapter_dir(lm, tmp_path / "a")).merge_and_unload().state_dict()
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)
        changed += not torch.equal(tensor, base[name])
    assert changed == 4  # q_proj and v_proj of two layers
    model = _fresh_base(lm)
    model.load_state_dict(merged, strict=False)
    torch.testing.assert_close(_logits(model), _logits(lm.model), atol=1e-5, rtol=0)


def test_a_fan_in_fan_out_layer_merges_as_peft_does(tmp_path: Path) -> None:
    """GPT-2's Conv1D stores its weight transposed: the delta is too."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                     n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.inject_adapter_in_model(lora, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    weights = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    lora.save_pretrained(tmp_path / "a")
    from safetensors.torch import save_file

    save_file(peft_state_dict(weights), str(tmp_path / "a" / ADAPTER_WEIGHTS))
    merged = merge_lora(read_base_weights([tmp_path / "base" / SINGLE]), weights,
                        json.loads((tmp_path / "a" / "adapter_config.json").read_text()))
    reference = peft.PeftModel.from_pretrained(
        transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base"),
        tmp_path / "a").merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)


def test_scaling_follows_peft() -> None:
    config = {"r": 8, "lora_alpha": 16, "rank_pattern": {"v_proj": 4},
              "alpha_pattern": {"layers.1.self_attn.q_proj": 2}}
    assert scaling(config, "model.layers.0.self_attn.q_proj", 8) == 2.0
    assert scaling(config, "model.layers.0.self_attn.v_proj", 4) == 4.0
    assert scaling(config, "model.layers.1.self_attn.q_proj", 8) == 0.25
    assert scaling({**config, "use_rslora": True, "rank_pattern": {}}, "x.q_proj", 8) == \
        pytest.approx(16 / 8 ** 0.5)
    with pytest.raises(CheckpointError, match="has rank 2 in the checkpoint, but "
                                              "adapter_config.json gives it r=8"):
        scaling(config, "x.q_proj", 2)


@pytest.mark.parametrize(("extra", "named"), [
    ({"use_dora": True}, "DoRA (use_dora)"),
    ({"bias": "lora_only"}, "trained biases (bias='lora_only')"),
    ({"modules_to_save": ["lm_head"]}, "fully trained modules (modules_to_save)"),
    ({"init_lora_weights": "pissa"}, "changes the base weights (init_lora_weights='pissa')"),
])
def test_unsupported_features_are_refused_by_name(extra: dict, named: str) -> None:
    for merge in (False, True):
        with pytest.raises(CheckpointError, match=f"uses .*{re.escape(named)}"):
            check_supported({"peft_type": "LORA", **extra}, merge=merge)


def test_activated_lora_is_exported_but_not_merged() -> None:
    check_supported({"alora_invocation_tokens": [5]}, merge=False)
    with pytest.raises(CheckpointError, match=r"activated LoRA \(alora_invocation_tokens\), "
                                              r"which cannot be merged"):
        check_supported({"alora_invocation_tokens": [5]}, merge=True)


def test_a_tensor_of_no_lora_linear_layer_is_refused() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(CheckpointError, match=r"'m.lora_embedding_A.default' .* no LoRA A or B"):
        lora_pairs({"m.lora_embedding_A.default": a})
    with pytest.raises(CheckpointError, match=r"LoRA layer 'm' has no lora_B weight"):
        lora_pairs({"m.lora_A.default.weight": a})


def test_export_files_do_not_load_torch() -> None:
    """`stalwart export` checks its --out and finds its checkpoint before torch loads."""
    code = ("import sys, stalwart.checkpointing.storage.export_peft\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# From a signed checkpoint.

def _export(storage: Path, out: Path, write) -> Path:
    return export_newest(str(storage), None, out, trust=trust(), on_skip=print, write=write,
                         check=check_out_dir)[1]


def _merged(checkpoint, weights, out):
    return write_merged(checkpoint, weights, out, max_shard_bytes=30_000)


def test_a_signed_checkpoint_exports_as_adapter_and_merged(tmp_path: Path) -> None:
    lm = lora_model(tmp_path, tied=True)
    storage = tmp_path / "checkpoints"
    lora_checkpoint(storage, 5, lm, tmp_path, tied=True)
    adapter = _export(storage, tmp_path / "adapter", write_peft)
    names = sorted(p.name for p in adapter.iterdir())
    assert names == ["adapter_config.json", ADAPTER_WEIGHTS, "tokenizer.json",
                     "tokenizer_config.json"]
    loaded = peft.PeftModel.from_pretrained(_fresh_base(lm), adapter).eval()
    torch.testing.assert_close(_logits(loaded), _logits(lm.model), atol=1e-5, rtol=0)

    merged = _export(storage, tmp_path / "merged", _merged)
    assert not (merged / "adapter_config.json").exists()
    assert (merged / "model.safetensors.index.json").exists()  # sharded past 30 kB
    model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(_logits(model), _logits(lm.model), atol=1e-5, rtol=0)
    assert model.generate(IDS, max_new_tokens=4, do_sample=False).shape == (1, 12)
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    assert tokenizer("w1 w2")["input_ids"] == [1, 2]


def test_a_changed_or_moved_base_model_is_refused(tmp_path: Path) -> None:
    lm = lora_model(tmp_path, tied=False)
    storage = tmp_path / "checkpoints"
    lora_checkpoint(storage, 5, lm, tmp_path, tied=False)
    weights_file = lm.base / SINGLE
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1
    weights_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"base model '{lm.base}': model.safetensors "
                                              rf"differs in size or sha256 from the one "
                                              rf"training read: the base model changed since "
                                              rf"training"):
        _export(storage, tmp_path / "merged", _merged)
    lm.base.rename(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"is not a directory: the base model changed"):
        base_model_files(find_step(str(storage), 5, trust()))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config", "checkpoints", "elsewhere", "tokenizer"]  # nothing written


def test_a_full_fine_tune_is_no_adapter(tmp_path: Path) -> None:
    lm = lora_model(tmp_path, tied=False)
    storage = tmp_path / "checkpoints"
    config = (lm.base / "config.json").read_bytes()
    full = read_base_weights([lm.base / SINGLE])
    commit_checkpoint(storage, 3, full, {"config.json": config},
                      {"base_model": base_model_entry(lm.base)})
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 holds no LoRA adapter \(a "
                                              r"full fine-tune\?\): export it with --format hf$"):
        _export(storage, tmp_path / "adapter", write_peft)
    with pytest.raises(CheckpointError, match="export it with --format hf, without --merge"):
        _export(storage, tmp_path / "merged", _merged)
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "merged").exists()


def test_plain_hf_export_of_an_adapter_is_refused(tmp_path: Path) -> None:
    lm = lora_model(tmp_path, tied=False)
    storage = tmp_path / "checkpoints"
    lora_checkpoint(storage, 5, lm, tmp_path, tied=False)
    with pytest.raises(CheckpointError, match=r"holds a LoRA adapter, not a whole model: "
                                              r"export it merged .* --format hf --merge"):
        _export(storage, tmp_path / "hf",
                lambda c, w, o: write_hf(c, w, o, max_shard_bytes=10**9))
