"""The docs document the interfaces: every CLI flag, config key and event kind; README is a front door.

docs/configuration.md and the schema in docs/run-directory.md are generated from the code
(`python docs/generate.py`); a test here fails when they are stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest

from stalwart.core.config import JobConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def load_generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


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


def cli_flags() -> list[tuple[str, str]]:
    from stalwart.cli.main import _parser

    flags = []
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                flags.append((command, ""))
                flags += [(command, opt) for a in sub._actions for opt in a.option_strings
                          if opt.startswith("--") and opt != "--help"]
    return flags


def test_generated_docs_are_fresh():
    gen = load_generator()
    assert gen.missing_config_docs() == [], "every config field needs a docstring"
    stale = [str(p.relative_to(ROOT)) for p in gen.stale()]
    assert not stale, f"{', '.join(stale)} stale: run `python docs/generate.py`"


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_is_in_the_generated_reference(key):
    text = (DOCS / "configuration.md").read_text()
    assert f"| `{key}` |" in text, f"config key {key} is missing from docs/configuration.md"


def test_every_event_kind_is_in_the_run_directory_schema():
    from stalwart.core.events import EVENT_TYPES

    text = (DOCS / "run-directory.md").read_text()
    assert {"started", "checkpoint_committed", "resumed", "finished"} <= set(EVENT_TYPES)
    for kind in EVENT_TYPES:
        assert f"#### `{kind}`" in text, f"event kind {kind} is missing from docs/run-directory.md"


def test_every_metrics_field_is_in_the_run_directory_schema():
    from stalwart.core.events import MetricsRow

    text = (DOCS / "run-directory.md").read_text().split("### Metrics rows", 1)[1]
    for f in dataclasses.fields(MetricsRow):
        assert f"| `{f.name}` |" in text, f"metrics field {f.name} is missing from docs/run-directory.md"


@pytest.mark.parametrize("command,flag", cli_flags())
def test_every_cli_command_and_flag_is_in_docs_cli(command, flag):
    text = (DOCS / "cli.md").read_text()
    section = text.split(f"## `stalwart {command}", 1)
    assert len(section) == 2, f"docs/cli.md has no section `## \\`stalwart {command} ...\\``"
    body = section[1].split("\n## ", 1)[0]
    assert not flag or f"`{flag}" in body, f"stalwart {command} {flag} is missing from docs/cli.md"


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200
    for section in ("## Quickstart", "## Commands", "## Failures"):
        assert section in README


def test_every_relative_link_resolves():
    for page in [ROOT / "README.md", ROOT / "bench" / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"


def test_quickstart_is_two_commands_and_ci_runs_the_test_command():
    quick = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", quick, flags=re.S)
    assert len(commands) == 2 and "stalwart run examples/gpt/config.toml" in commands[0]
    test_command = commands[1].split("&&", 1)[1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
