"""What `stalwart submit` ships to the cluster: the working directory, less what a job never
needs, and never a credential.

Ray packs a job's `working_dir` itself. It walks the directory and leaves out what matches the
runtime_env's `excludes` (gitignore-style patterns: `name/` is a directory at any depth,
`/name` is anchored at the working directory), Ray's own defaults (`.git`, `.venv`, `venv`,
`__pycache__`; RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES changes them) and whatever each
`.gitignore` (unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and `.rayignore` on the way names.
`listing` walks with Ray's own walk and matchers (stalwart.core.ray_private.walk_working_dir),
so what `submit` counts and `submit --dry-run` lists is exactly what Ray would pack.

Caller's contract: a symbolic link is followed, as Ray follows it, and what it points to ships
under the link's name; `--dry-run` shows where each such file really is.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stalwart.core.errors import ConfigError
from stalwart.core.ray_private import walk_working_dir

# Credentials a working directory may hold, by the names their tools give them. A job needs
# none of them: the cluster's own identity (a pod's service account, a node's role) serves it.
# A pattern with a `/` before its end is anchored at the working directory, so those that live
# in a tool's directory (`.config/gh/`) start with `**/`: a copy of $HOME's dotfiles anywhere
# below is left out too.
SECRET_EXCLUDES = (
    # .env, .env.local, .envrc (direnv), a virtual environment named .env
    ".env*",
    # cloud and cluster credentials and tool configs that embed tokens
    ".aws/", ".azure/", "**/.config/gcloud/", ".kube/", ".docker/", ".netrc", "_netrc",
    ".git-credentials", ".pypirc", ".npmrc",
    # Google: service-account keys and OAuth client secrets by the names they are saved under,
    # gcloud's application-default credentials, and the `credentials.json` of Google's
    # quickstarts (and of many other tools)
    "*service-account*.json", "client_secret*.json", "application_default_credentials.json",
    "credentials.json",
    # tokens of the tools a training project uses: Hugging Face (HF_HOME's token and
    # stored_tokens, the older ~/.huggingface/), GitHub's CLI, Kaggle, Vault, Databricks
    "**/.cache/huggingface/token", "**/.cache/huggingface/stored_tokens", ".huggingface/",
    "**/.config/gh/", ".kaggle/", "kaggle.json", ".vault-token", ".databrickscfg",
    # passwords and keys in the config files of PostgreSQL, s3cmd and boto
    ".pgpass", ".s3cfg", ".boto",
    # Terraform: state and variables hold the secrets of the infrastructure they describe
    # (`*.tfstate.*`: its backups); .terraform/ holds the backend's settings
    "*.tfstate", "*.tfstate.*", "*.tfvars", "*.tfvars.json", ".terraform/",
    # keys: SSH (by OpenSSH's file names; a bare `id_*` would drop `id_utils.py` too),
    # TLS and PKCS#12 bundles, GnuPG, stalwart's checkpoint key (~/.config/stalwart/*.key)
    ".ssh/", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.pem", "*.key", "*.p12",
    "*.pfx", ".gnupg/",
    # Ray's token: ~/.ray/auth_token, and deploy/local's DIR/auth_token wherever DIR is
    ".ray/", "auth_token",
)

# Environment variables that name a secret file (or a directory of them) by path, whatever its
# name: Ray's token file, stalwart's checkpoint signing key, and the credentials of the tools
# above when they are kept elsewhere than their usual names.
SECRET_FILE_ENV_VARS = (
    "RAY_AUTH_TOKEN_PATH", "STALWART_CHECKPOINT_KEY_FILE", "GOOGLE_APPLICATION_CREDENTIALS",
    "AWS_SHARED_CREDENTIALS_FILE", "HF_TOKEN_PATH", "KAGGLE_CONFIG_DIR", "GH_CONFIG_DIR",
    "DATABRICKS_CONFIG_FILE", "PGPASSFILE", "BOTO_CONFIG",
)
# ... and those that name several, separated by os.pathsep: previous checkpoint keys, trusted
# to verify; kubectl's configs.
SECRET_PATH_LIST_ENV_VARS = ("STALWART_CHECKPOINT_TRUSTED_KEY_FILES", "KUBECONFIG")


def secret_files_in(cwd: Path, environ: Mapping[str, str], named: Iterable[str] = ()
                    ) -> list[str]:
    """Anchored excludes for the secret files inside `cwd` that the environment names, and for
    those `named` by the caller (a checkpoint key file), whatever their names. A relative path
    is taken against `cwd`, as the process that reads it takes it; a path through a symbolic
    link is left out both where it is named and where it leads."""
    values = [environ.get(var, "") for var in SECRET_FILE_ENV_VARS]
    values += [v for var in SECRET_PATH_LIST_ENV_VARS
               for v in environ.get(var, "").split(os.pathsep)]
    excludes: list[str] = []
    for value in filter(None, (*values, *named)):
        named_path = Path(os.path.normpath(cwd / Path(value).expanduser()))
        for path in (named_path, named_path.resolve()):
            if path.is_relative_to(cwd) and path != cwd:
                # anchored, its glob characters escaped: this one file only
                rel = re.sub(r"([*?\[\\])", r"\\\1", path.relative_to(cwd).as_posix())
                if f"/{rel}" not in excludes:
                    excludes.append(f"/{rel}")
    return excludes


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One file (or empty directory, which Ray packs too) of the upload."""

    path: str
    """Relative to the working directory, `/`-separated; an empty directory ends in `/`."""
    size: int
    """Bytes Ray reads for it (a symbolic link's target's)."""
    target: Path | None = None
    """Where the bytes really are, when a symbolic link leads outside the working directory."""


@dataclass(frozen=True, kw_only=True)
class Upload:
    """The package Ray would make of `working_dir`."""

    working_dir: Path
    entries: tuple[Entry, ...]

    @property
    def files(self) -> int:
        return sum(not e.path.endswith("/") for e in self.entries)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def summary(self) -> str:
        return f"{self.files} files, {self.size} bytes ({self.size / 2**20:.1f} MiB)"


def refuse_home_or_root(cwd: Path, home: Path | None = None) -> None:
    """A job ships its working directory: from $HOME or above it, that is every dotfile,
    key and cache the user has."""
    home = (Path.home() if home is None else home).resolve()
    if cwd == Path(cwd.anchor) or home.is_relative_to(cwd):
        where = "the root directory" if cwd == Path(cwd.anchor) else (
            "your home directory" if cwd == home else "a directory that holds your home")
        raise ConfigError(f"refusing to submit from {cwd}, {where}: a job ships its whole "
                          f"working directory to the cluster; cd into the project that holds "
                          f"the config and submit from there")


def listing(working_dir: Path, excludes: list[str]) -> Upload:
    """Every file Ray packs of `working_dir` given the runtime_env's `excludes`, found by Ray's
    own walk (`_dir_travel`) with the matchers and ignore files it applies."""
    root = working_dir.absolute()
    entries: list[Entry] = []

    def handler(path: Path) -> None:
        # packaging._zip_files' handler: a file, or an empty directory.
        empty_dir = path.is_dir() and next(path.iterdir(), None) is None
        if not (empty_dir or path.is_file()):
            return
        real = path.resolve()
        entries.append(Entry(path=path.relative_to(root).as_posix() + ("/" if empty_dir else ""),
                             size=0 if empty_dir else path.stat().st_size,
                             target=None if real.is_relative_to(root.resolve()) else real))

    # (Ray's logger would announce every ignore file found, at INFO, on stderr)
    walk_working_dir(root, excludes, handler, logger=logging.getLogger(__name__))
    return Upload(working_dir=root, entries=tuple(sorted(entries, key=lambda e: e.path)))


def withheld(upload: Upload, excludes: list[str], secret: Collection[str]) -> tuple[Entry, ...]:
    """What the `secret` patterns among `excludes` keep out of `upload`: the entries a listing
    without them holds and `upload` lacks. (A file that a `.gitignore` or another exclude
    leaves out too is not counted: it would stay behind without the secret rules.)"""
    shipped = {e.path for e in upload.entries}
    rest = listing(upload.working_dir, [p for p in excludes if p not in secret])
    return tuple(e for e in rest.entries if e.path not in shipped)


def describe(upload: Upload, left_out: tuple[Entry, ...] = ()) -> str:
    """`submit --dry-run`'s listing: one `SIZE PATH` line per entry, the totals, then one
    `left out (credential): PATH` line per file the secret rules keep back."""
    width = max((len(str(e.size)) for e in upload.entries), default=1)
    lines = [f"{e.size:>{width}}  {e.path}" + (f"  (link to {e.target})" if e.target else "")
             for e in upload.entries]
    lines.append(f"would upload {upload.summary()} from {upload.working_dir}")
    lines += [f"left out (credential): {e.path}" for e in left_out]
    return "\n".join(lines)
