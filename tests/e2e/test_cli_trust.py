"""Trust boundaries from the command line: someone who can write the checkpoint storage or
the run directory, but has no key, cannot make `run --resume`, `export` or `report` load
altered weights or run code."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.storage.layout import MANIFEST, step_dir_name
from stalwart.core import events as E
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart
from tests.e2e.checkpoints import run_dir_with_checkpoints
from tests.unit.test_report import clean_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


class Payload:
    """A pickle that creates a marker file when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _recompute_manifest(d: Path, *, keep_signature: bool = False) -> None:
    """What an attacker without the key can do after changing files: new sizes and hashes;
    the signature either dropped or left as it was."""
    manifest = json.loads((d / MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        data = (d / name).read_bytes()
        meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    if not keep_signature:
        del manifest["signature"], manifest["key_id"]
    (d / MANIFEST).write_text(json.dumps(manifest))


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / step_dir_name(step)


@pytest.mark.parametrize("keep_signature, why", [(False, "it is not signed"),
                                                 (True, "the manifest was altered")])
def test_a_tampered_shard_with_a_recomputed_manifest_is_refused(tmp_path, keep_signature,
                                                                why) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    shard = _step(run, 10) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _recompute_manifest(_step(run, 10), keep_signature=keep_signature)

    proc = stalwart("export", str(run), "--step", "10", "--out", "model.pt", cwd=tmp_path,
                    check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("stalwart: error: checkpoint ") and "step_000000010" in line
    assert why in line and not (tmp_path / "model.pt").exists()

    config = str(REFERENCE_CONFIG)
    resume = stalwart("run", config, *sets(*TINY), "--run-dir", str(run), "--resume",
                      cwd=tmp_path, check=2)
    assert "none verifies" in resume.stderr and why in resume.stderr
    assert not (run / "events.jsonl").exists()  # refused before anything was started


def test_an_unsigned_checkpoint_is_exported_only_with_trust_unsigned(tmp_path: Path) -> None:
    run, weights = run_dir_with_checkpoints(tmp_path, (10,))
    _recompute_manifest(_step(run, 10))  # as made elsewhere, or before signing: intact
    refused = stalwart("export", str(run), "--out", "model.pt", cwd=tmp_path, check=2)
    assert "not signed; --trust-unsigned accepts it" in refused.stderr
    assert not (tmp_path / "model.pt").exists()

    proc = stalwart("export", str(run), "--out", "model.pt", "--trust-unsigned", cwd=tmp_path)
    assert "exporting step 10 although it is not signed (--trust-unsigned)" in proc.stderr
    out = torch.load(tmp_path / "model.pt")
    assert out.keys() == weights[10].keys()
    assert all(torch.equal(out[k], weights[10][k]) for k in out)


@pytest.mark.parametrize("trusting", [(), ("--trust-unsigned",)])
def test_a_metadata_pickle_runs_nothing_on_export_or_resume(tmp_path, trusting) -> None:
    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    marker = tmp_path / "pwned"
    (_step(run, 10) / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _recompute_manifest(_step(run, 10))

    proc = stalwart("export", str(run), "--out", "model.pt", *trusting, cwd=tmp_path, check=2)
    assert "step 10" in proc.stderr
    if trusting:  # verified as unsigned-but-accepted, then refused by the restricted reader
        assert ".metadata is not DCP metadata" in proc.stderr
    assert not marker.exists() and not (tmp_path / "model.pt").exists()
    if not trusting:
        resume = stalwart("run", str(REFERENCE_CONFIG), *sets(*TINY), "--run-dir", str(run),
                          "--resume", cwd=tmp_path, check=2)
        assert "not signed" in resume.stderr
    assert not marker.exists()


def test_report_and_export_import_nothing_from_a_run_dir(tmp_path: Path) -> None:
    run, weights = run_dir_with_checkpoints(tmp_path, (10,))
    marker = tmp_path / "pwned"
    planted = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    for module in ("matplotlib", "evil_task", "safetensors", "torch_planted"):
        (run / f"{module}.py").write_text(planted + "class Task: ...\n")
    config = run / "config.toml"
    config.write_text(config.read_text().replace(
        '"stalwart.examples.gpt.task:GPTTask"', '"evil_task:Task"'))
    assert '"evil_task:Task"' in config.read_text()
    events, rows = clean_run()
    (run / "events.jsonl").write_text("".join(E.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(E.dumps(r) + "\n" for r in rows))

    proc = stalwart("export", ".", "--out", "model.safetensors", cwd=run)
    assert "exported step 10" in proc.stdout
    from safetensors.torch import load_file

    out = load_file(run / "model.safetensors")
    assert all(torch.equal(out[k], weights[10][k]) for k in weights[10])
    stalwart("report", ".", cwd=run)
    assert (run / "report.png").stat().st_size > 0  # matplotlib (the real one) drew it
    assert not marker.exists()


def test_shards_zeroed_after_the_check_are_skipped_never_exported(tmp_path: Path) -> None:
    """Files are checked as they are read, not only beforehand: a zeroed shard (same size,
    so the listing still matches) is a damaged checkpoint, and the older one is exported."""
    run, weights = run_dir_with_checkpoints(tmp_path, (10, 20))
    shard = _step(run, 20) / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    proc = stalwart("export", str(run), "--out", "model.pt", cwd=tmp_path)
    assert ("skipping checkpoint step 20" in proc.stderr
            and "__0_0.distcp is damaged: its size or sha256 differs from the signed "
                "manifest" in proc.stderr)
    out = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(out[k], weights[10][k]) for k in weights[10])


def test_a_tensor_claimed_larger_than_the_files_is_an_error_not_an_allocation(
        tmp_path: Path) -> None:
    from stalwart.checkpointing.safe_load import load_metadata

    run, _ = run_dir_with_checkpoints(tmp_path, (10,))
    path = _step(run, 10) / ".metadata"
    metadata = load_metadata(path.read_bytes(), "x")
    name = next(n for n in metadata.state_dict_metadata if n.startswith("model."))
    metadata.state_dict_metadata[name].size = torch.Size([1 << 20, 1 << 20])  # 4 TiB
    path.write_bytes(pickle.dumps(metadata))
    _recompute_manifest(_step(run, 10))  # only --trust-unsigned gets this far
    proc = stalwart("export", str(run), "--out", "model.pt", "--trust-unsigned",
                    cwd=tmp_path, check=2)
    assert "claims model tensors of" in proc.stderr and "more than its files hold" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deleting_newer_checkpoints_does_not_roll_a_resume_back(tmp_path: Path) -> None:
    """Someone who can write storage deletes the newest checkpoints (or damages them): a
    resume would silently go back. The run dir recorded the commits, so it is refused."""
    run, _ = run_dir_with_checkpoints(tmp_path, (10, 20, 30))
    (run / "events.jsonl").write_text("".join(
        E.dumps(E.CheckpointCommitted(time=1.0 + s, step=s, path=str(_step(run, s)),
                                      save_s=0.1)) + "\n" for s in (10, 20, 30)))
    import shutil

    shutil.rmtree(_step(run, 30))
    shard = _step(run, 20) / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    proc = stalwart("run", str(REFERENCE_CONFIG), *sets(*TINY), "--run-dir", str(run),
                    "--resume", cwd=tmp_path, check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert "records step 30 as committed, but the newest checkpoint that verifies is " \
           "step 10" in line and "__0_0.distcp is damaged" in line
    assert "would lose steps 11-30" in line and "--allow-rollback" in line
