"""The CLI on a local Ray, with storage checkpoints damaged the ways checksums cannot catch
(garbled before their commit) or can: a checkpoint that fails to load is skipped and the next
older valid one used on --resume; a resume that finds none valid is refused by name; and a
run's storage, owned by it, keeps working across --resume. The Ray a run starts on this
machine asks every client for its token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.keys import signing_key

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

RUN = [*TINY, "scaling.num_workers=2", "checkpoint.persist_every=2", "checkpoint.keep_last=3",
       "checkpoint.async_save=false", "run.log_every=1", "data.val_every=100",
       "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, local_ray) -> Path:
    """One 6-step run, committed at steps 2, 4 and 6, that each test damages a copy of."""
    cwd = tmp_path_factory.mktemp("six")
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, "train.steps=6"), "--run-dir", "run",
                  cwd=cwd)
    return cwd / "run"


@pytest.fixture
def run(six_steps, tmp_path) -> Path:
    """This test's copy of the 6-step run, at tmp_path/run (its owner and run id kept)."""
    return Path(shutil.copytree(six_steps, tmp_path / "run"))


def _garble_and_recommit(storage, step: int) -> None:
    """Damage the data before the commit: the manifest's checksums match, the load fails."""
    d = storage / step_dir_name(step)
    for shard in d.glob("__*_0.distcp"):
        shard.write_bytes(b"\x00" * 64)
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").unlink()
    write_manifest(str(storage), step, {k: manifest[k] for k in ("world_size", "task", "run_id")
                                        if k in manifest}, ranks=manifest["ranks"],
                   key=signing_key())


def test_resume_skips_a_checkpoint_that_fails_to_load(run, tmp_path) -> None:
    config = str(REFERENCE_CONFIG)
    storage = run / "checkpoints"
    owner = json.loads((storage / "owner.json").read_text())
    assert owner["run_id"] == (run / "run_id").read_text().strip()
    _garble_and_recommit(storage, 6)

    stalwart_here("run", config, *sets(*RUN, "train.steps=8"), "--run-dir", "run", "--resume",
                  cwd=tmp_path)
    events = read_jsonl(run / "events.jsonl")
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [6]
    assert "failed to load" in skipped[0]["message"]
    started = [e for e in events if e["kind"] == "started"]
    assert started[-1]["start_step"] == 4
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 8
    assert json.loads((storage / "owner.json").read_text()) == owner  # still this run's


def test_resume_with_every_checkpoint_damaged_names_each(run, tmp_path) -> None:
    config = str(REFERENCE_CONFIG)
    storage = run / "checkpoints"
    for step in (2, 4, 6):
        shard = storage / step_dir_name(step) / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-1])
    proc = stalwart_here("run", config, *sets(*RUN, "train.steps=8"), "--run-dir", "run",
                         "--resume", cwd=tmp_path, check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("stalwart: error: --resume: checkpoints were committed under ")
    assert "but none verifies" in line
    assert all(f"step_00000000{step}" in line for step in (2, 4, 6))
    assert "file __1_0.distcp is damaged" in line


def test_resume_from_unsigned_checkpoints_needs_trust_unsigned(run, tmp_path) -> None:
    config = str(REFERENCE_CONFIG)
    storage = run / "checkpoints"

    def strip(*keys: str) -> None:
        for step in (2, 4, 6):
            path = storage / step_dir_name(step) / "manifest.json"
            manifest = json.loads(path.read_text())
            path.write_text(json.dumps({k: v for k, v in manifest.items() if k not in keys}))

    # A manifest that names this run must be signed by a trusted key, even with
    # --trust-unsigned: this run signs what it writes, so stripping the signature is an attack.
    strip("signature", "key_id")
    before = (run / "events.jsonl").read_bytes()
    refused = stalwart_here("run", config, *sets(*RUN, "train.steps=8"), "--run-dir", "run",
                            "--resume", "--trust-unsigned", cwd=tmp_path, check=2)
    assert "it names this run, but it is not signed" in refused.stderr
    strip("run_id")  # as written before signing and run ids, or elsewhere: intact, unsigned

    refused = stalwart_here("run", config, *sets(*RUN, "train.steps=8"), "--run-dir", "run",
                            "--resume", cwd=tmp_path, check=2)
    assert "none verifies" in refused.stderr and "step_000000006" in refused.stderr
    assert "it is not signed; --trust-unsigned accepts it" in refused.stderr
    assert (run / "events.jsonl").read_bytes() == before

    stalwart_here("run", config, *sets(*RUN, "train.steps=8"), "--run-dir", "run", "--resume",
                  "--trust-unsigned", cwd=tmp_path)
    events = read_jsonl(run / "events.jsonl")
    accepted = [e for e in events if e["kind"] == "unsigned_checkpoint_accepted"]
    assert [(e["step"], e["why"]) for e in accepted] == [(6, "it is not signed")]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 8
    newest = json.loads((storage / step_dir_name(8) / "manifest.json").read_text())
    assert newest["run_id"] == (run / "run_id").read_text().strip()
    assert len(newest["signature"]) == 64  # what the run writes from then on is signed


def test_the_ray_a_run_starts_here_asks_for_a_token() -> None:
    """Every Ray stalwart starts is authenticated: deploy/'s (tests/unit/test_deploy_trust.py)
    and the one `stalwart run` starts without --address (stalwart.cluster.connect, as
    local_ray starts it). Ray turns its token mode on for it; nothing may turn it off."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    @ray.remote(num_cpus=0)
    def worker_side() -> bool:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return is_token_auth_enabled()

    assert is_token_auth_enabled()
    assert ray.get(worker_side.remote(), timeout=60)
