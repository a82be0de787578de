"""`stalwart sweep` refuses bad input with one line and exit code 2, before Ray starts and
without creating anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.parallel.distributed import free_port
from tests.cli_helpers import REFERENCE_CONFIG, stalwart

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SWEEP = f'''config = "{REFERENCE_CONFIG}"
metric = "loss"
[search]
"train.lr" = {{ loguniform = [1e-4, 1e-2] }}
'''


@pytest.mark.parametrize(("text", "message"), [
    (SWEEP.replace("loguniform = [1e-4, 1e-2]", "loguniform = [0, 1e-2]"),
     "[search] train.lr: loguniform needs low > 0, got 0"),
    (SWEEP.replace('metric = "loss"', 'metric = "accuracy"'),
     "metric: 'accuracy' is never reported by a stalwart run"),
    (SWEEP.replace("train.lr", "train.learning_rate"), "train.learning_rate"),
])
def test_bad_sweep_file(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "sweep.toml").write_text(text)
    proc = stalwart("sweep", "sweep.toml", cwd=tmp_path, check=2, timeout=60)
    assert proc.stderr.startswith("stalwart: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.toml"]


def test_unreachable_cluster(tmp_path: Path) -> None:
    (tmp_path / "sweep.toml").write_text(SWEEP)
    proc = stalwart("sweep", "sweep.toml", "--address", f"127.0.0.1:{free_port()}",
                    cwd=tmp_path, check=2, timeout=60)
    assert "nothing answers there" in proc.stderr
