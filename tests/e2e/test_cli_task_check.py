"""A bug in the user's task, as a newcomer meets it on the command line: `stalwart run` tries
the task on the driver and refuses a wrong `in_features` before Ray starts, naming the module
and the user's own line; `stalwart submit` refuses a task that does not import before it
contacts any cluster.

Each command runs as the console script a user types, with a RAY_TMPDIR of its own: Ray
creates its session there as soon as it starts, so an empty one afterwards shows that no Ray
(and so no worker) was started. No Ray is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.parallel.distributed import free_port
from tests.cli_helpers import STALWART

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXIT_BAD_INPUT = 2  # stalwart/cli/main.py: bad input, nothing was started

CONFIG = textwrap.dedent("""\
    [task]
    path = "my_task:MyTask"

    [scaling]
    num_workers = 1

    [train]
    steps = 5
    warmup_steps = 1
    global_batch_size = 16
    micro_batch_size = 16
""")

# Two features per sample, and a first layer that expects three: the newcomer's bug.
WRONG_IN_FEATURES = textwrap.dedent("""\
    import torch
    from torch import nn

    from stalwart import TrainTask


    class Points:
        def __len__(self):
            return 64

        def get_batch(self, indices):
            idx = torch.as_tensor(indices)
            return torch.randn(len(idx), 2), idx % 3


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(3, 32)
            self.out = nn.Linear(32, 3)

        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))


    class MyTask(TrainTask):
        def build_model(self, config):
            return Net()

        def train_dataset(self, config):
            return Points()
""")

MISSING_PACKAGE = "import not_installed_pkg\n\nfrom stalwart import TrainTask\n"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))  # short: Ray's socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stalwart(cwd: Path, ray_tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    return subprocess.run([STALWART, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


def project(root: Path, task: str) -> Path:
    (root / "config.toml").write_text(CONFIG)
    (root / "my_task.py").write_text(task)
    return root


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_run_refuses_a_wrong_in_features_with_the_users_line_before_ray(
        tmp_path: Path, ray_tmp: Path) -> None:
    cwd = project(tmp_path, WRONG_IN_FEATURES)
    proc = stalwart(cwd, ray_tmp, "run", "config.toml", "--run-dir", "run")
    shown = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == EXIT_BAD_INPUT, shown
    first = proc.stderr.splitlines()[0]
    assert first.startswith(
        "stalwart: error: task check: the forward pass failed in module `hidden` "
        "(Linear(in_features=3, out_features=32, bias=True)), given input of shape (2, 2): "
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"), shown
    line = line_of(WRONG_IN_FEATURES, "return self.out(torch.relu(self.hidden(x)))")
    assert f'File "{cwd / "my_task.py"}", line {line}, in forward' in proc.stderr, shown
    assert 'task.check = "build"' in proc.stderr  # how to skip it, should it be wrong
    assert not any(ray_tmp.iterdir()), "Ray was started"
    assert not (cwd / "run").exists()


def test_submit_refuses_a_task_that_does_not_import_before_contacting_the_cluster(
        tmp_path: Path, ray_tmp: Path) -> None:
    cwd = project(tmp_path, MISSING_PACKAGE)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = stalwart(cwd, ray_tmp, "submit", "config.toml", "--address", nobody)
    shown = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == EXIT_BAD_INPUT, shown
    assert proc.stderr.startswith(
        "stalwart: error: task path 'my_task:MyTask': cannot import module 'my_task': "
        "ModuleNotFoundError: No module named 'not_installed_pkg'\n"), shown
    assert f'File "{cwd / "my_task.py"}", line 1, in <module>' in proc.stderr, shown
    assert "nothing answers there" not in proc.stderr  # the task's error, not the cluster's
    assert "uploading" not in proc.stdout
    assert not any(ray_tmp.iterdir()), "Ray was started"
