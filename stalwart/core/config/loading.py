"""Loading, overriding and dumping a JobConfig as TOML.

``load_config`` reads TOML, applies ``--set a.b=value`` overrides and refuses unknown keys,
so a typo never silently falls back to a default. Values are checked against the fields'
type hints; ``dump_config`` writes a config that loads back equal.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from stalwart.core.config.job import JobConfig
from stalwart.core.errors import ConfigError
from stalwart.core.spelling import did_you_mean


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check a TOML value against a field's type hint (TOML already has typed values)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        # `int | str` (checkpoint.snapshot_every: a number or a word): the first kind that
        # takes the value; the section's own check then says which words it accepts.
        kinds = typing.get_args(hint)
        for kind in kinds:
            try:
                return _coerce(value, kind, name)
            except ConfigError:
                continue
        names = [k.__name__ for k in kinds]
        raise ConfigError(f"{name} = {value!r} is invalid: expected "
                          f"{' or '.join(('an ' if n[0] in 'aeiou' else 'a ') + n for n in names)}")
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            try:
                value = float(value)
            except OverflowError:  # a TOML integer past a float's range
                raise ConfigError(f"{name} = {value!r} is invalid: too large for a float") \
                    from None
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is dict or hint is dict:
        ok = isinstance(value, dict)
    elif origin is list and typing.get_args(hint) == (int,):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                             for v in value)
        value = list(value) if ok else value
    elif origin is list and typing.get_args(hint) == (str,):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = list(value) if ok else value
    else:
        raise ConfigError(f"{name}: unexpected field type {hint!r}")
    if not ok:
        type_name = getattr(hint, "__name__", None) or str(hint)
        raise ConfigError(f"{name} = {value!r} is invalid: expected a {type_name}")
    return value


# Keys that are no longer read. An empty value (what older config.toml files hold) is
# dropped; a set one is refused with the reason, so a config never seems to do what it does not.
RETIRED_KEYS = {
    "checkpoint.key_file": "the key is never taken from a config, which travels with its run "
                           "directory: pass --key-file FILE (run, export, status, sweep) or set "
                           "$STALWART_CHECKPOINT_KEY_FILE, and remove the key from the config",
}


def _drop_retired(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    kept = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if name not in RETIRED_KEYS:
            kept[key] = value
        elif value not in ("", None):
            raise ConfigError(f"{name} = {value!r} is no longer read: {RETIRED_KEYS[name]}")
    return kept


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    data = _drop_retired(data, prefix)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        section = prefix + "." if prefix else ""
        raise ConfigError(
            f"unknown key {section}{unknown[0]} in {where}; "
            f"{did_you_mean(unknown[0], known, prefix=section)}allowed: {', '.join(known)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        # Only [[faults]] tables have keys without a default; a plain TypeError would say so
        # in Python's words (and as a traceback).
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"[[{prefix}]] table {data!r} has no key {missing[0]}; required: "
                          f"{', '.join(required)}")
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        hint = hints[key]
        if typing.get_origin(hint) is tuple:  # [[faults]]: an array of tables
            (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
            if not isinstance(value, list | tuple) or not all(isinstance(v, dict)
                                                                for v in value):
                raise ConfigError(f"{name} must be an array of tables ([[{name}]]), "
                                  f"got {value!r}")
            kwargs[key] = tuple(_build(item, v, name) for v in value)
        elif dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a table ([{name}]), got {value!r}")
            kwargs[key] = _build(hint, value, name)
        else:
            kwargs[key] = _coerce(value, hint, name)
    return cls(**kwargs)


def _parse_value(raw: str) -> Any:
    """Parse an override's value as TOML (so 2, 1e-3, true, "x", [1] work); bare words are strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def flatten(data: dict[str, Any], *, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """Nested tables as `section.key` -> value. A table named in `keep`, or an empty one,
    stays one value (`task.args` compared whole)."""
    out: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value and key not in keep:
            for name, inner in value.items():
                walk(inner, f"{key}.{name}" if key else str(name))
        else:
            out[key] = value

    walk(data, "")
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides to a nested dict (copying what it changes)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r} is invalid: expected section.key=value, "
                              f"e.g. --set train.steps=100")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
            child = dict(child)
            node[part] = child
            node = child
        node[leaf] = _parse_value(raw.strip())
    return data


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    return _build(JobConfig, data, "")


def read_toml(path: str | Path, what: str = "config file",
              error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A TOML file's table; `error` names `what` the file is when it is missing or invalid."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist (expected a TOML file)")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} {str(p)!r} is not valid TOML: {exc}") from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load a JobConfig from a TOML file (None: defaults) plus `--set` overrides."""
    data = read_toml(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, list(overrides)))


def dump_config(config: JobConfig) -> str:
    """The resolved config as TOML; load_config of it gives back an equal JobConfig."""
    import tomli_w

    return tomli_w.dumps(config.to_dict())
