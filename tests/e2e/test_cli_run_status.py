"""`stalwart status RUN_DIR` as a user types it, on the run dir of a real short run: what it
says when the run finished, when a checkpoint was damaged since, and when the driver was
lost without recording an end; it imports nothing from the run dir or the current one."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpointing.storage.layout import step_dir_name
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SHORT = [*TINY, "train.steps=6", "train.warmup_steps=1", "checkpoint.persist_every=3",
         "checkpoint.keep_last=0", "data.val_every=0"]


def test_status_of_a_real_run_dir(tmp_path: Path) -> None:
    stalwart("run", str(REFERENCE_CONFIG), *sets(*SHORT), "--run-dir", "run", cwd=tmp_path)
    run = tmp_path / "run"

    done = stalwart("status", "run", cwd=tmp_path, check=0)
    lines = done.stdout.splitlines()
    assert lines[0] == "run run: FINISHED"
    assert "  step:       6 of 6" in lines
    assert f"  checkpoint: step 6, verified: {run / 'checkpoints' / step_dir_name(6)}" in lines
    assert not any("continue" in line for line in lines) and done.stderr == ""

    # Step 6's shard damaged since: named, never loaded; step 3 is the one to go on from.
    shard = run / "checkpoints" / step_dir_name(6) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # The driver lost before its end was written (killed outright): the log just stops.
    events = (run / "events.jsonl").read_text().splitlines(keepends=True)
    assert '"kind": "finished"' in events[-1]
    (run / "events.jsonl").write_text("".join(events[:-1]))
    # Modules planted where a careless command would import them: never run.
    marker = tmp_path / "pwned"
    planted = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    for where in (run, tmp_path):
        for module in ("evil_task", "torch", "ray", "fsspec", "tomli_w"):
            (where / f"{module}.py").write_text(planted)
    config = run / "config.toml"
    config.write_text(config.read_text().replace('"stalwart.examples.gpt.task:GPTTask"',
                                                 '"evil_task:Task"'))

    lost = stalwart("status", ".", cwd=run, check=3)
    lines = lost.stdout.splitlines()
    assert lines[0] == "run .: RUNNING, or its driver was lost (no end recorded)"
    assert "  step:       6 of 6" in lines  # the last metrics row
    assert "  checkpoint: step 3, verified: " in lost.stdout
    assert any(line.startswith("  not verified (never loaded): step 6: ") and
               "file __1_0.distcp is damaged" in line for line in lines)
    assert lines[-1] == ("  continue:   if its driver is gone: stalwart run config.toml "
                         "--run-dir . --auto-resume --allow-rollback  (loses steps 4-6: step "
                         "6 was committed and no longer verifies)")
    assert not marker.exists()
