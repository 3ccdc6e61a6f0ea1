"""Read, override and write the configuration tree of :mod:`zerotron.config` (DESIGN contract 6).

- :func:`load_config`: a YAML/JSON file plus dotted overrides (``train.lr=3e-4``); the model preset is
  applied first and explicit model fields win over it; every value coerced to its field's type.
- :func:`~zerotron.config_check.validate` (its own module): every check that can run before a rank
  starts (ranges, choices, divisibility, what is not built).
- :func:`~zerotron.config_deepspeed.from_deepspeed` (its own module): a DeepSpeed ``ds_config.json``
  mapped onto the tree.
- :func:`save_config` / :func:`to_dict` / :func:`describe_fields`.

Every problem is a :class:`ConfigError` whose one-line message names the key and what to change. No
torch here: ``zerotron plan`` and the loader run anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from zerotron.config import SECTIONS, Config, ModelConfig
from zerotron.presets import PRESETS


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "list": list}
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "dict": "a mapping",
    "list": "a list",
}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.6)
    hint = f" — did you mean '{close[0]}'?" if close else "; see `zerotron train --help-config`"
    return ConfigError(f"unknown key '{key}'{hint}")


def _field(section: str, name: str) -> dataclasses.Field[Any]:
    if section not in SECTIONS:
        raise _unknown(f"{section}.{name}")
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return f
    raise _unknown(f"{section}.{name}")


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    """``value`` as the field's declared type (annotations are strings: ``"Optional[int]"``, ``"float"``)."""
    text = str(annotation)
    optional = text.startswith("Optional[")
    base = text[len("Optional[") : -1] if optional else text
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if value is None:
        raise ConfigError(f"{key}: must be {_TYPE_WORDS.get(base, base)}, not null")
    kind = _SCALARS.get(base)
    if kind is None:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if kind in (int, float) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{key}: expected {_TYPE_WORDS.get(base, base)}, got {value!r}")
    return value


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override {item!r}: write section.key=value, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(
            f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'} ({e})".replace("\n", " ")
        ) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    return data


def _flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise (
                _unknown(str(section))
                if "." in str(section)
                else ConfigError(f"{source}: unknown section '{section}'; sections are {', '.join(SECTIONS)}")
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys")
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def load_config(
    path: str | None,
    overrides: list[str] | tuple[str, ...] = (),
    between: dict[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """The config of ``path`` (YAML/JSON; None for the defaults) with ``key=value`` overrides applied.

    ``defaults`` holds dotted keys that replace the tree's defaults (``zerotron sft``'s): the file, a
    mapped DeepSpeed config and the overrides all win over them.
    ``between`` holds dotted keys applied after the file and before the overrides (a mapped DeepSpeed
    config: the command line wins over it). Model fields: defaults, then the preset's architecture, then
    every model field given explicitly. ``model.path`` without an explicit ``model.preset`` clears the
    preset (the file has the architecture).
    """
    flat = dict(defaults or {})
    flat.update(_flatten(_read_file(path), path) if path else {})
    flat.update(between or {})
    for item in overrides:
        key, value = _parse_override(item)
        flat[key] = value
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        f = _field(section, name)
        values[section][name] = _coerce(key, f.type, value)
    model_values = values.pop("model")
    if model_values.get("path") and "preset" not in model_values:
        model_values["preset"] = None
    preset = model_values.get("preset", ModelConfig.preset)
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    model = ModelConfig(**{**(PRESETS[preset] if preset else {}), **model_values})
    return Config(model=model, **{s: SECTIONS[s](**v) for s, v in values.items()})


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (JSON/YAML ready)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (loads back to an equal config with :func:`load_config`)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def describe_fields() -> str:
    """Every key with its type, default and help text (``zerotron train --help-config``)."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:  {(cls.__doc__ or '').strip().splitlines()[0]}")
        default = cls()
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            lines.append(
                f"  {section}.{f.name} ({f.type}, default {value!r})\n      {f.metadata.get('help', '')}"
            )
    return "\n".join(lines)


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """A command line's positional items as (the config file or model, if any, and the ``key=value``
    overrides); a second file is an error."""
    config = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"more than one config file given ({config!r}, {item!r})")
    return config, overrides
