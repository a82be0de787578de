"""`stalwart export` as a user types it, on real DCP checkpoints of the reference task's model:
which checkpoint it passes over and why, its temporary file, and an unwritable --out; and on a
LoRA fine-tune's checkpoint, the adapter and the merged model loaded back by peft and
transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from tests.cli_helpers import stalwart
from tests.e2e.checkpoints import run_dir_with_checkpoints
from tests.keys import signing_key
from tests.lora_checkpoints import lora_checkpoint, lora_model, run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _recommit_garbled(run: Path, step: int) -> None:
    """Damage step's data the way no checksum catches: garbled before its commit."""
    d = run / "checkpoints" / step_dir_name(step)
    (d / "__0_0.distcp").write_bytes(b"\x00" * 64)
    (d / "manifest.json").unlink()
    write_manifest(str(run / "checkpoints"), step, {"world_size": 1}, ranks=1,
                   key=signing_key())


def test_export_says_which_checkpoint_it_skipped_and_why(tmp_path: Path) -> None:
    run, weights = run_dir_with_checkpoints(tmp_path, (10, 20, 30))
    _recommit_garbled(run, 30)  # verifies, fails to load
    shard = run / "checkpoints" / step_dir_name(20) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])  # fails its checksum
    proc = stalwart("export", str(run), "--out", "model.pt", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("stalwart: skipping checkpoint step 30: ")
    # its .metadata places the weights past the end of the garbled shard: never read
    assert "which holds 64; not loaded" in lines[0] and "step_000000030" in lines[0]
    assert lines[1].startswith("stalwart: skipping checkpoint step 20: ")
    assert "file __0_0.distcp is damaged" in lines[1]
    assert "exported step 10 of" in proc.stdout
    out = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(out[k], weights[10][k]) for k in weights[10])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "run"]


def test_export_of_a_step_that_fails_to_load_is_a_clean_error(tmp_path: Path) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    _recommit_garbled(run, 10)
    proc = stalwart("export", str(run), "--step", "10", "--out", "model.pt", cwd=tmp_path,
                    check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("stalwart: error: checkpoint ") and "not loaded" in line
    assert not (tmp_path / "model.pt").exists()


def test_export_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("model.safetensors.tmp", ".model.safetensors.tmp"):
        (tmp_path / name).symlink_to(victim)
    stalwart("export", str(run), "--out", "model.safetensors", cwd=tmp_path)
    assert victim.read_text() == "precious"
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors").is_symlink()
    leftovers = {p.name for p in tmp_path.iterdir()} - {"run", "victim", "model.safetensors"}
    assert leftovers == {"model.safetensors.tmp", ".model.safetensors.tmp"}  # untouched


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_export_to_an_unwritable_place_is_a_clean_error(tmp_path: Path) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for out in (locked / "model.pt", locked / "sub" / "model.pt"):
            proc = stalwart("export", str(run), "--out", str(out), cwd=tmp_path, check=2)
            (line,) = proc.stderr.strip().splitlines()
            assert line.startswith(f"stalwart: error: --out {str(out)!r}: ")
            assert "is not a writable directory" in line
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("out", ["afile/model.pt", "/proc/model.pt", "/proc/self/x/model.pt"])
def test_export_under_a_file_or_proc_is_a_clean_error(tmp_path: Path, out: str) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    (tmp_path / "afile").write_text("x")
    proc = stalwart("export", str(run), "--out", out, cwd=tmp_path, check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"stalwart: error: --out {out!r}: ")
    assert (tmp_path / "afile").read_text() == "x"


def test_export_skips_a_manifest_of_the_wrong_shape(tmp_path: Path) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10, 20))
    (run / "checkpoints" / step_dir_name(20) / "manifest.json").write_text(json.dumps([1]))
    proc = stalwart("export", str(run), "--out", "model.pt", cwd=tmp_path)
    assert "stalwart: skipping checkpoint step 20: " in proc.stderr
    assert "a JSON list, not an object" in proc.stderr
    assert "exported step 10 of" in proc.stdout


def _lora_run(tmp_path: Path):
    pytest.importorskip("peft")
    lm = lora_model(tmp_path, tied=True)
    run = run_dir(tmp_path)
    lora_checkpoint(run / "checkpoints", 8, lm, tmp_path, tied=True)
    return run, lm


def test_export_of_a_lora_fine_tune_as_adapter_and_merged(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, lm = _lora_run(tmp_path)
    proc = stalwart("export", str(run), "--format", "peft", "--out", "adapter", cwd=tmp_path)
    assert "exported step 8 of" in proc.stdout
    stalwart("export", str(run), "--format", "hf", "--merge", "--out", "merged", cwd=tmp_path)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.no_grad():
        expected = lm.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(lm.base).eval()
        adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapter(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    prompt = AutoTokenizer.from_pretrained(tmp_path / "merged")("w3 w14", return_tensors="pt")
    generated = merged.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 6)


def test_export_of_a_lora_fine_tune_refuses_bad_input(tmp_path: Path) -> None:
    run, lm = _lora_run(tmp_path)
    proc = stalwart("export", str(run), "--format", "peft", "--merge", "--out", "x",
                    cwd=tmp_path, check=2)
    assert proc.stderr.strip() == ("stalwart: error: export: --merge goes with --format hf "
                                   "only (it writes the merged model as a Hugging Face model "
                                   "directory), not --format peft")
    weights = lm.base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    proc = stalwart("export", str(run), "--format", "hf", "--merge", "--out", "merged",
                    cwd=tmp_path, check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"stalwart: error: base model {str(lm.base.resolve())!r}: "
                           f"model.safetensors differs in size or sha256 from the one "
                           f"training read: the base model changed since training")
    full, _ = run_dir_with_checkpoints(tmp_path / "full", (10,))
    proc = stalwart("export", str(full), "--format", "peft", "--out", "adapter", cwd=tmp_path,
                    check=2)
    assert proc.stderr.strip() == ("stalwart: error: checkpoint step 10 holds no LoRA adapter "
                                   "(a full fine-tune?): export it with --format hf")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "adapter").exists()
