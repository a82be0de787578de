"""Bad profiling steps on the `stalwart run` command line: one clear error line, exit code 2,
before Ray starts (its own RAY_TMPDIR stays empty) and with nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

STALWART = Path(sys.executable).with_name("stalwart")
REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"


@pytest.mark.parametrize(("args", "error"), [
    (["--profile", "5-x"], "--profile '5-x' is invalid: expected STEP or FIRST-LAST (both "
                           "included), e.g. --profile 20 or --profile 20-22"),
    (["--profile", "6-5"], "--profile '6-5' is invalid: steps count from 1, and FIRST must be "
                           "<= LAST"),
    (["--set", "train.steps=12", "--set", "train.warmup_steps=2", "--profile", "12-13"],
     "--profile '12-13': run.profile_steps = [12, 13] is invalid: steps must be <= "
     "train.steps = 12"),
    (["--set", "run.profile_steps=[0]"],
     "run.profile_steps = [0] is invalid: [] (off), [STEP] or [FIRST, LAST] with "
     "1 <= FIRST <= LAST"),
], ids=["syntax", "order", "past-the-end", "config-key"])
def test_bad_profile_steps(tmp_path: Path, args: list[str], error: str) -> None:
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.toml")
    ray_tmp = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))  # short: Ray's socket paths
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["RAY_TMPDIR"] = str(ray_tmp)
        proc = subprocess.run([str(STALWART), "run", "config.toml", *args, "--run-dir", "r"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr) == (
            2, "", f"stalwart: error: {error}\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]
        assert not any(ray_tmp.iterdir()), "Ray was started"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
