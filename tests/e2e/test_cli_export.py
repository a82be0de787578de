"""`stalwart export` as a user types it, on real DCP checkpoints of the reference task's model:
which checkpoint it passes over and why, its temporary file, and an unwritable --out."""

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
