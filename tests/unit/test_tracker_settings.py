"""A tracker's settings are checked when the Trainer is made, before Ray or any worker: W&B
online with no API key is one clear error naming both ways out (a key, or offline mode),
instead of a traceback at the first metrics row. The key is looked for where wandb looks:
the environment, the netrc file `wandb login` writes, wandb's settings files."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.integrations.wandb_logger import check_settings
from stalwart.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REFUSAL = (r'run.loggers = \["wandb"\] needs a W&B API key or offline mode, and has neither: '
           r"run `wandb login` \(or set WANDB_API_KEY\) to log to W&B, or set "
           r"WANDB_MODE=offline to write the run under RUN_DIR/wandb/ without an account")
KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_wandb_settings(tmp_path: Path, monkeypatch) -> Path:
    """A machine where nobody ran `wandb login` or `wandb offline`: every place wandb reads
    a key or a mode from is empty (and under tmp_path, not the user's home)."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED",
                 "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "workdir"))
    return tmp_path


def test_online_with_no_key_is_refused_when_the_trainer_is_made(no_wandb_settings: Path
                                                                 ) -> None:
    pytest.importorskip("wandb")
    run_dir = no_wandb_settings / "run"
    with pytest.raises(ConfigError, match=REFUSAL):
        Trainer(load_config(None, ['run.loggers=["wandb"]']), run_dir=run_dir)
    assert not run_dir.exists()


@pytest.mark.parametrize(("name", "value"), [
    ("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_MODE", "dryrun"),
    ("WANDB_DISABLED", "true"), ("WANDB_API_KEY", KEY),
    ("WANDB_IDENTITY_TOKEN_FILE", "/var/run/secrets/wandb-token"),
])
def test_offline_mode_or_a_key_in_the_environment_is_enough(no_wandb_settings: Path,
                                                            monkeypatch, name: str,
                                                            value: str) -> None:
    monkeypatch.setenv(name, value)
    check_settings()


def test_online_mode_named_explicitly_still_needs_a_key(no_wandb_settings: Path,
                                                        monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=REFUSAL):
        check_settings()


@pytest.mark.parametrize(("base_url", "machine", "found"), [
    (None, "api.wandb.ai", True),
    (None, "api.forge.coreweave.com", True),
    (None, "example.com", False),
    ("https://wandb.example.com", "wandb.example.com", True),
    ("https://wandb.example.com", "api.wandb.ai", False),
])
def test_a_key_that_wandb_login_saved_in_netrc(no_wandb_settings: Path, monkeypatch,
                                               base_url: str | None, machine: str,
                                               found: bool) -> None:
    if base_url:
        monkeypatch.setenv("WANDB_BASE_URL", base_url)
    (no_wandb_settings / "netrc").write_text(f"machine {machine}\n  login user\n"
                                             f"  password {KEY}\n")
    if found:
        check_settings()
    else:
        with pytest.raises(ConfigError, match=REFUSAL):
            check_settings()


def test_a_damaged_netrc_holds_no_key(no_wandb_settings: Path) -> None:
    """wandb, too, warns and reads no key from a netrc file it cannot parse."""
    (no_wandb_settings / "netrc").write_text(f"machine api.wandb.ai login user password {KEY}\n"
                                             f"bogus token\n")
    with pytest.raises(ConfigError, match=REFUSAL):
        check_settings()


@pytest.mark.parametrize(("where", "text", "found"), [
    ("wandb-config/settings", "[default]\nmode = offline\n", True),  # `wandb offline`
    ("workdir/wandb/settings", "[default]\nmode = disabled\n", True),  # `wandb disabled`
    ("wandb-config/settings", f"[default]\napi_key = {KEY}\n", True),
    ("wandb-config/settings", "[default]\nmode = online\n", False),
    ("wandb-config/settings", "not a settings file\n", False),
])
def test_wandbs_settings_files(no_wandb_settings: Path, where: str, text: str,
                               found: bool) -> None:
    path = no_wandb_settings / where
    path.parent.mkdir(parents=True)
    path.write_text(text)
    if found:
        check_settings()
    else:
        with pytest.raises(ConfigError, match=REFUSAL):
            check_settings()


def test_the_environment_wins_over_the_settings_files(no_wandb_settings: Path,
                                                      monkeypatch) -> None:
    path = no_wandb_settings / "workdir" / "wandb" / "settings"
    path.parent.mkdir(parents=True)
    path.write_text("[default]\nmode = offline\n")
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=REFUSAL):
        check_settings()


def test_what_the_check_accepts_wandb_accepts(no_wandb_settings: Path, monkeypatch) -> None:
    """The netrc file the check reads is the one wandb reads its key from."""
    wbnetrc = pytest.importorskip("wandb.sdk.lib.wbauth.wbnetrc")  # moves between releases

    (no_wandb_settings / "netrc").write_text(f"machine api.wandb.ai login user password {KEY}\n")
    check_settings()
    assert wbnetrc.read_netrc_auth(host="https://api.wandb.ai") == KEY
