"""The README's quickstart quotes a recorded run, not a memory of one: its time, its first and
last losses and the summary it shows are those of docs/recorded/readme_run.json, which
`python -m bench.readme_run` writes by running the quickstart's command as typed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RECORD_PATH = ROOT / "docs" / "recorded" / "readme_run.json"
RECORD = json.loads(RECORD_PATH.read_text())


def section(title: str) -> str:
    return README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def prose(text: str) -> str:
    """The text with its line breaks as spaces: a figure may wrap."""
    return re.sub(r"\s+", " ", text)


def test_the_record_is_of_the_quickstarts_command() -> None:
    from bench.readme_run import README_COMMAND

    first = re.findall(r"```bash\n(.+?)\n```", section("Quickstart"), flags=re.S)[0]
    assert RECORD["command"] == README_COMMAND and first.endswith(f"&& {README_COMMAND}")
    assert "docs/recorded/readme_run.json" in section("Quickstart")


def test_the_time_is_the_recorded_one() -> None:
    wall = RECORD["wall_s"]
    minutes = f"{round(wall / 30) / 2:g}"  # to the half minute
    text = prose(section("Quickstart"))
    assert f"about {minutes} minutes on {RECORD['machine']['cpus']} CPU cores ({round(wall)} s" in (
        text)


def test_the_losses_are_the_recorded_ones() -> None:
    first, final = RECORD["first_logged"], RECORD["final"]
    text = prose(section("Quickstart"))
    assert (f"falls from {first['loss']:.1f} at step {first['step']} to about "
            f"{final['loss']:.1f} nats per byte at step {final['step']}") in text


def test_the_summary_shown_is_the_recorded_one() -> None:
    (block,) = re.findall(r"```\n(.+?)\n```", section("What you see"), flags=re.S)
    assert block.splitlines() == RECORD["summary"]
    # ... and its summary holds the final figures the record read from the run's metrics.
    final = RECORD["final"]
    summary = block.split("FINISHED", 1)[1]
    assert f"{final['loss']:.4f}" in summary and f"{final['val_loss']:.4f}" in summary


def test_the_quickstart_installs_what_the_readme_then_uses() -> None:
    first = re.findall(r"```bash\n(.+?)\n```", section("Quickstart"), flags=re.S)[0]
    assert '-e ".[report]"' in first  # `stalwart report` draws its figure with it
    assert "--index-url https://download.pytorch.org/whl/cpu" in section("Quickstart")
