"""The import rules of the house (docs/architecture.md), checked on the source text.

The rooms below the top floor (orchestrator/, workers/, parallel/, checkpointing/) import from
`stalwart` only the basement, stalwart.core, and the rooms below them; the basement imports no
room. workers/, parallel/ and checkpointing/ sit below the driver: they never import the CLI, the
trainer, orchestrator/, examples/, integrations/, report/ or plan/. checkpointing/ never imports
workers/, and stalwart/plan/ never imports the example it used to read shapes from. Every
import counts, wherever it stands: a lazy one inside a function or one under
TYPE_CHECKING couples the modules all the same. Importing stalwart.parallel (and each of its
modules) does not load Ray, and importing stalwart loads neither torch, Ray nor the trainer;
those two are checked in a fresh interpreter, since this one has loaded everything already.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]

# The driver's rooms, which the lower floors never reach into.
DRIVER = (
    "stalwart.cli",
    "stalwart.trainer",
    "stalwart.orchestrator",
    "stalwart.examples",
    "stalwart.integrations",
    "stalwart.report",
    "stalwart.plan",
)

# The basement: the one part of `stalwart` that the lower rooms may import.
BASEMENT = "stalwart.core"

# folder on disk -> (its import name, the parts of `stalwart` it may import). Anything else
# under `stalwart` (the top floor: the API, cli/, the trainer, integrations/, report/, plan/,
# the run directory) is forbidden to it.
ALLOWED: dict[str, tuple[str, tuple[str, ...]]] = {
    "stalwart/core": (BASEMENT, (BASEMENT,)),
    "orchestrator": ("stalwart.orchestrator", (BASEMENT, "stalwart.orchestrator",
                                               "stalwart.workers", "stalwart.parallel",
                                               "stalwart.checkpointing")),
    "workers": ("stalwart.workers", (BASEMENT, "stalwart.workers", "stalwart.parallel",
                                     "stalwart.checkpointing")),
    "parallel": ("stalwart.parallel", (BASEMENT, "stalwart.parallel")),
    "checkpointing": ("stalwart.checkpointing", (BASEMENT, "stalwart.checkpointing")),
}

# folder on disk -> (its import name, the module prefixes it must never import): the rules
# for the top floor's own rooms.
RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    # The plan room reads the model's shape from the task (TrainTask.model_dims), not from
    # the example, and is pure arithmetic beside the driver.
    "stalwart/plan": (
        "stalwart.plan",
        ("stalwart.examples", "stalwart.cli", "stalwart.trainer", "stalwart.orchestrator"),
    ),
}


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_modules(
    source: str, module: str, *, is_package: bool = False
) -> list[tuple[int, str]]:
    """Every module a source imports, as (line, absolute name): top level, inside functions
    and under TYPE_CHECKING alike. `from a import b` counts as both `a` and `a.b` (b may be a
    module); relative imports are resolved against `module`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(
    source: str, module: str, forbidden: tuple[str, ...], *, is_package: bool = False
) -> list[str]:
    """The imports of `source` that reach a forbidden module (or anything below it)."""
    bad: dict[int, str] = {}
    for line, name in imported_modules(source, module, is_package=is_package):
        for prefix in forbidden:
            if line not in bad and (name == prefix or name.startswith(prefix + ".")):
                bad[line] = f"{module}:{line} imports {name} (forbidden: {prefix})"
    return [bad[line] for line in sorted(bad)]


def outside(source: str, module: str, allowed: tuple[str, ...], *,
            is_package: bool = False) -> list[str]:
    """The imports of `source` that reach a part of `stalwart` not under one of `allowed`."""
    bad: dict[int, str] = {}
    for line, name in imported_modules(source, module, is_package=is_package):
        if name != "stalwart" and not name.startswith("stalwart."):
            continue
        if line not in bad and not any(name == a or name.startswith(a + ".") for a in allowed):
            bad[line] = f"{module}:{line} imports {name} (allowed: {', '.join(allowed)})"
    return [bad[line] for line in sorted(bad)]


def _room_violations(folder: str, package: str, check) -> list[str]:
    base = ROOT / folder
    bad = []
    for path in sorted(base.rglob("*.py")):
        module = _module_name(package, base, path)
        bad += check(path.read_text(), module, is_package=path.name == "__init__.py")
    return bad


def test_checker_flags_a_lazy_and_a_type_checking_import():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    from stalwart.workers.reports import CommitReport\n"
        "def f():\n"
        "    import stalwart.trainer\n"
        "    from stalwart import cli\n"
    )
    found = violations(source, "stalwart.checkpointing.x", (*DRIVER, "stalwart.workers"))
    assert found == [
        "stalwart.checkpointing.x:5 imports stalwart.workers.reports (forbidden: stalwart.workers)",
        "stalwart.checkpointing.x:7 imports stalwart.trainer (forbidden: stalwart.trainer)",
        "stalwart.checkpointing.x:8 imports stalwart.cli (forbidden: stalwart.cli)",
    ]


def test_checker_resolves_relative_imports():
    found = violations(
        "from ..orchestrator import controller\n", "stalwart.parallel.recipe", DRIVER
    )
    assert found == [
        "stalwart.parallel.recipe:1 imports stalwart.orchestrator "
        "(forbidden: stalwart.orchestrator)"
    ]


def test_checker_lets_allowed_imports_through():
    source = (
        "import stalwart.core.config\nfrom stalwart.events import Failure\nimport stalwart.parallel\n"
    )
    assert violations(source, "stalwart.workers.actor", DRIVER) == []


def test_basement_checker_flags_the_top_floor_and_the_bare_package():
    source = (
        "from stalwart.core import events\n"
        "from stalwart import Trainer\n"
        "import stalwart.run_dir\n"
        "from stalwart.checkpointing import snapshot\n"
        "import torch\n"
    )
    found = outside(source, "stalwart.workers.x", ALLOWED["workers"][1])
    assert [f.split(" (")[0] for f in found] == [
        "stalwart.workers.x:2 imports stalwart",
        "stalwart.workers.x:3 imports stalwart.run_dir",
    ]
    assert outside(source, "stalwart.core.x", (BASEMENT,))[-1].startswith(
        "stalwart.core.x:4 imports stalwart.checkpointing")


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_rooms_import_only_the_basement_and_lower_rooms(folder):
    package, allowed = ALLOWED[folder]
    bad = _room_violations(folder, package, lambda src, mod, **kw: outside(src, mod, allowed, **kw))
    assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(RULES))
def test_top_floor_rooms_keep_their_rules(folder):
    package, forbidden = RULES[folder]
    bad = _room_violations(folder, package,
                           lambda src, mod, **kw: violations(src, mod, forbidden, **kw))
    assert not bad, "layering violations:\n" + "\n".join(bad)


def _loaded_after(modules: list[str], watched: tuple[str, ...]) -> dict[str, list[str]]:
    """Import `modules` one after another in a fresh interpreter; for each, the watched
    modules loaded once it is in (the first one to load a watched module is the culprit)."""
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"    out[m] = [n for n in {watched!r} if n in sys.modules]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stalwart_import_is_light():
    loaded = _loaded_after(["stalwart"], ("torch", "ray", "stalwart.trainer"))
    assert loaded == {"stalwart": []}


def test_a_worker_handle_does_not_load_torch():
    """Ray imports an actor's class wherever a handle to it arrives: the node agents, which
    poll the ranks, must not pay seconds of importing torch for that."""
    loaded = _loaded_after(["stalwart.workers.actor", "stalwart.workers.node_agent"],
                           ("torch",))
    assert loaded == {"stalwart.workers.actor": [], "stalwart.workers.node_agent": []}


def test_export_and_plan_check_their_input_without_torch():
    """`stalwart export` checks --out and finds its checkpoint, and `stalwart plan --params`
    plans, before torch loads: a mistake there is told in a fraction of a second."""
    modules = ["stalwart.checkpointing.storage.export", "stalwart.checkpointing.storage.export_hf",
               "stalwart.cli.plan", "stalwart.plan.estimate", "stalwart.plan.search"]
    loaded = _loaded_after(modules, ("torch",))
    assert loaded == {m: [] for m in modules}


def test_parallel_does_not_load_ray():
    modules = ["stalwart.parallel"] + [
        f"stalwart.parallel.{p.stem}"
        for p in sorted((ROOT / "parallel").glob("*.py"))
        if p.stem != "__init__"
    ]
    loaded = _loaded_after(modules, ("ray",))
    assert {m: v for m, v in loaded.items() if v} == {}


PRIVATE_RAY = ("ray._private", "ray._raylet", "ray.train._internal", "._actor_id")
RAY_PRIVATE_OWNER = ROOT / "stalwart" / "core" / "ray_private.py"


def test_private_ray_apis_are_used_in_one_module_only():
    """Ray's private names move between releases; one module owns them, so an upgrade is
    checked in one place (stalwart/core/ray_private.py, which names the Ray it was read from)."""
    bad = []
    for folder in ("stalwart", "orchestrator", "workers", "parallel", "checkpointing", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == RAY_PRIVATE_OWNER:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if any(name in code for name in PRIVATE_RAY) and not code.lstrip().startswith(
                        ("`", '"', "'")):
                    bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "private Ray APIs outside stalwart/core/ray_private.py:\n" + "\n".join(bad)
