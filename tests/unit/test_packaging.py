"""Packaging: every folder with an __init__.py installs under `stalwart`, and bare imports are banned.

The subsystem folders sit at the repository root and map into the `stalwart` package through
`[tool.setuptools.package-dir]` (docs/architecture.md); a folder missing from `packages` would
be left out of a wheel while still importing from a source checkout, so it is checked here.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
# Folders that hold Python but are not part of the installed package.
NOT_PACKAGED = {"tests", "bench", "deploy", "build", "dist"}


def _setuptools() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]


def _package_dir(package: str, mapping: dict[str, str]) -> Path:
    """The folder setuptools builds `package` from (a mapped parent carries its children)."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return REPO.joinpath(mapping[prefix], *parts[cut:])
    base = mapping.get("")
    return REPO.joinpath(base, *parts) if base else REPO.joinpath(*parts)


def _packages_on_disk() -> set[Path]:
    """Every folder that is a Python package reachable from a top-level package folder."""
    found: set[Path] = set()
    for top in sorted(REPO.iterdir()):
        if (not top.is_dir() or top.name.startswith((".", "_")) or top.name in NOT_PACKAGED
                or top.name.endswith(".egg-info")):
            continue
        stack = [top]
        while stack:
            folder = stack.pop()
            if not (folder / "__init__.py").is_file():
                continue
            found.add(folder)
            stack.extend(p for p in folder.iterdir()
                         if p.is_dir() and p.name != "__pycache__")
    return found


def test_the_top_level_subsystems_are_found_on_disk() -> None:
    # guards the scan itself: if it finds nothing, the comparison below proves nothing
    names = {p.relative_to(REPO).as_posix() for p in _packages_on_disk()}
    assert {"stalwart", "orchestrator", "workers", "parallel", "checkpointing", "examples",
            "examples/gpt"} <= names


def test_every_package_folder_is_listed() -> None:
    st = _setuptools()
    mapping = st.get("package-dir", {})
    listed = {_package_dir(p, mapping): p for p in st["packages"]}
    missing = sorted(p.relative_to(REPO).as_posix() for p in _packages_on_disk() - set(listed))
    assert not missing, (f"folders with an __init__.py missing from [tool.setuptools] packages "
                         f"in pyproject.toml: {missing}")


def test_every_listed_package_exists_on_disk() -> None:
    st = _setuptools()
    mapping = st.get("package-dir", {})
    for package in st["packages"]:
        assert package == "stalwart" or package.startswith("stalwart."), package
        folder = _package_dir(package, mapping)
        assert (folder / "__init__.py").is_file(), f"{package} -> {folder} has no __init__.py"


def test_package_dir_maps_only_listed_packages() -> None:
    st = _setuptools()
    assert set(st.get("package-dir", {})) <= set(st["packages"])


@pytest.mark.parametrize("package", _setuptools()["packages"])
def test_listed_package_imports(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__name__ == package
    folder = _package_dir(package, _setuptools().get("package-dir", {}))
    assert Path(module.__file__).resolve().parent == folder.resolve()


# ---------------------------------------------------------------------------- lint rule


def _ruff(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("ruff") is None and shutil.which("ruff") is None:
        pytest.skip("ruff is not installed")
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(PYPROJECT),
         "--select", "TID251", "--output-format", "concise", str(probe)],
        capture_output=True, text=True, timeout=30, cwd=tmp_path)


@pytest.mark.parametrize("source", [
    "import workers\n", "import orchestrator.controller\n",
    "from checkpointing import catalog\n", "from parallel.distributed import x\n",
    "import examples.gpt\n",
])
def test_bare_subsystem_import_is_banned(tmp_path: Path, source: str) -> None:
    proc = _ruff(tmp_path, source)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "TID251" in proc.stdout
    assert "never the bare folder name" in proc.stdout


def test_import_through_stalwart_is_allowed(tmp_path: Path) -> None:
    proc = _ruff(tmp_path, "import stalwart.workers\nfrom stalwart.orchestrator import states\n"
                           "print(stalwart.workers, states)\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TID251" not in proc.stdout
