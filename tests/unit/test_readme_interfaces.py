"""The README documents the interfaces: every config key, event kind and metrics field."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from stalwart.config import JobConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def config_keys() -> list[str]:
    hints = typing.get_type_hints(JobConfig)
    keys = []
    for section in dataclasses.fields(JobConfig):
        hint = hints[section.name]
        if dataclasses.is_dataclass(hint):
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(hint)]
        else:  # an array of tables, e.g. [[faults]]: its fields are documented as faults.x
            (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(item)]
    return keys


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_is_documented(key):
    assert f"| `{key}` |" in README, f"config key {key} is missing from README's table"


def test_every_emitted_event_kind_is_documented():
    from stalwart.events import EVENT_TYPES

    kinds = set(EVENT_TYPES)
    assert {"started", "checkpoint_committed", "resumed", "finished"} <= kinds
    for kind in kinds:
        assert f"| `{kind}` |" in README, f"event kind {kind} is missing from README"


def test_quickstart_is_two_commands_and_ci_runs_the_test_command():
    quick = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", quick, flags=re.S)
    assert len(commands) == 2 and "stalwart run examples/gpt/config.toml" in commands[0]
    test_command = commands[1].split("&&", 1)[1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
