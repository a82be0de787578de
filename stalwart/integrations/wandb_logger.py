"""Weights & Biases: a run's metrics, its resolved config and its failures, recoveries and
resizes, as one W&B run (`run.loggers = ["wandb"]`).

W&B's own settings apply: `WANDB_PROJECT` (else `run.name`), `WANDB_ENTITY`, `WANDB_API_KEY`,
and `WANDB_MODE=offline` to write without an account (`wandb sync` uploads later). Its files
go under `<run dir>/wandb/`. Written on the driver from the rows and events the run writes.

A run that would log online with no API key is refused before it starts (check_settings),
rather than failing at its first row: the key is looked for where wandb looks (the
environment, the netrc file `wandb login` writes, wandb's settings files), without importing
wandb, which takes seconds.

- config: the resolved config, nested as in config.toml;
- history: the names of stalwart/integrations/run_log.py, against a `step` metric (a restore
  trains steps again, and W&B's own step may only grow, so the training step is a column);
- summary: `stalwart/events`, the text of each failure, recovery, resize and injected fault,
  and `stalwart/state` at the end.
"""

from __future__ import annotations

import atexit
import configparser
import importlib.util
import netrc
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from stalwart.core.errors import ConfigError
from stalwart.core.events import Event, MetricsRow
from stalwart.integrations.loggers import Tracker
from stalwart.integrations.run_log import EventScalars, describe, event_step, row_scalars

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

# W&B modes that need no account: offline writes the run locally, disabled writes nothing.
KEYLESS_MODES = ("offline", "dryrun", "disabled")
# The hosts `wandb login` saves a key for in the netrc file when no base URL is set: W&B's
# API, and the CoreWeave Forge address that newer wandb releases use for it.
DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def check_available() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.loggers = [\"wandb\"] needs the wandb package: "
                          "pip install 'stalwart[wandb]'")


def check_settings() -> None:
    """Refuse a W&B run that would fail at its first row: online, with no API key."""
    settings = _settings_files()
    if _mode(settings) in KEYLESS_MODES or _has_key(settings):
        return
    raise ConfigError(
        "run.loggers = [\"wandb\"] needs a W&B API key or offline mode, and has neither: run "
        "`wandb login` (or set WANDB_API_KEY) to log to W&B, or set WANDB_MODE=offline to "
        "write the run under RUN_DIR/wandb/ without an account (`wandb sync` uploads it later)")


def _settings_files() -> dict[str, str]:
    """wandb's settings files, merged: the global one (WANDB_CONFIG_DIR, else
    ~/.config/wandb), then the directory's (`wandb offline` writes there), which wins."""
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
    root = Path(os.environ.get("WANDB_DIR") or ".").expanduser()
    merged: dict[str, str] = {}
    for path in (config_dir / "settings", root / "wandb" / "settings",
                 root / ".wandb" / "settings"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
            merged.update(parser.items("default") if parser.has_section("default") else ())
        except (OSError, configparser.Error):  # wandb warns and goes on without it
            continue
    return merged


def _mode(settings: dict[str, str]) -> str:
    """WANDB_MODE, else the settings files' mode."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return "disabled"
    return (os.environ.get("WANDB_MODE") or settings.get("mode") or "online").strip().lower()


def _has_key(settings: dict[str, str]) -> bool:
    """Whether wandb finds credentials: the environment, the netrc file, a settings file."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    if settings.get("api_key"):
        return True
    base_url = os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or ""
    host = urlsplit(base_url).netloc
    hosts = {host} if host and host not in DEFAULT_HOSTS else set(DEFAULT_HOSTS)
    return _netrc_has(hosts)


def _netrc_has(hosts: set[str]) -> bool:
    """Whether the netrc file wandb reads ($NETRC, else ~/.netrc, else ~/_netrc) holds a
    key for one of `hosts`."""
    home = Path("~").expanduser()
    path = (Path(os.environ["NETRC"]).expanduser() if os.environ.get("NETRC") else
            next((p for p in (home / ".netrc", home / "_netrc") if p.exists()), None))
    if path is None:
        return False
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):  # wandb, too, reads no key from it
        return False
    return any((creds := entries.authenticators(host)) is not None and creds[2]
               for host in hosts)


class WandbLogger(Tracker):
    name = "wandb"

    def __init__(self, config: JobConfig, run_dir: Path) -> None:
        check_available()
        check_settings()
        self.config = config
        self.run_dir = Path(run_dir)
        self.run: Any = None
        self._events = EventScalars()
        self._texts: list[str] = []
        self._lock = threading.Lock()

    def _open(self) -> Any:
        """The W&B run, started at the first row or event (so a run refused before it starts
        leaves nothing in the tracker)."""
        if self.run is None:
            import wandb

            self.run_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or self.config.run.name,
                name=self.run_dir.name, dir=str(self.run_dir), config=self.config.to_dict(),
                reinit="create_new",  # one W&B run per stalwart run, even in one process
                settings=wandb.Settings(console="off", silent=True))
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            self.run = run
            atexit.register(self._end, "FAILED")  # an exception never reaches on_end
        return self.run

    def on_metrics(self, row: MetricsRow) -> None:
        with self._lock:
            self._open().log({"step": row.step, **row_scalars(row)})

    def on_event(self, event: Event) -> None:
        text = describe(event)
        if text is None:
            return
        with self._lock:
            run = self._open()
            scalars = self._events.of(event)
            if scalars:
                run.log({"step": event_step(event), **scalars})
            self._texts.append(text)
            run.summary["stalwart/events"] = list(self._texts)

    def on_end(self, result: Any) -> None:
        self._end(getattr(result, "state", "FAILED"))

    def _end(self, state: str) -> None:
        with self._lock:
            if self.run is None:
                return
            atexit.unregister(self._end)
            self.run.summary["stalwart/state"] = state
            self.run.finish(exit_code=0 if state in ("FINISHED", "STOPPED") else 1)
            self.run = None

    def abandon(self) -> None:
        with self._lock:  # wandb's own exit hook finishes whatever it holds
            atexit.unregister(self._end)
            self.run = None
