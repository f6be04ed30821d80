"""TOML text <-> config data: ``--set`` overrides, the dotted keys of a model (for "did you
mean"), and the resolved config written into every run folder. Shared with the simulator's
scenarios (``parse_override``, ``apply_override``, ``known_keys``)."""

from __future__ import annotations

import tomllib
from typing import TYPE_CHECKING

from pydantic import BaseModel

from echo_rl.core.config_sections import ConfigError

if TYPE_CHECKING:
    from echo_rl.core.config import EchoConfig


def parse_override(item: str, error: type[Exception] = ConfigError) -> tuple[list[str], object]:
    """``section.key=value`` (value in TOML syntax, a bare word being a string) -> (path,
    value: any TOML value, checked later by the model it configures). Shared with the simulator's scenarios, which raise their own ``error``."""
    if "=" not in item:
        raise error(f"override {item!r} has no '=': write --set section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is taken as a string: --set model.name=/models/qwen3
    return key.split("."), value


def apply_override(
    data: dict[str, object], path: list[str], value: object, error: type[Exception] = ConfigError
) -> None:
    """``value`` set at ``path`` in TOML data (tables made on the way)."""
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise error(f"override {'.'.join(path)}: {part!r} is not a table")
        node = child
    node[path[-1]] = value


# Keys renamed to the units convention (docs/config.md: sizes in MiB, memory in GiB): old
# dotted key -> (new key, factor: new value = old value * factor, how it is said). An old name
# is refused with the new one and the converted value, never read in the wrong unit.
RENAMED: dict[str, tuple[str, float, str]] = {
    "broadcast.chunk_kib": ("broadcast.chunk_mib", 1 / 1024, "KiB / 1024"),
}


def renamed_hint(key: str, value: object) -> str:
    """What an operator whose TOML still says ``key`` must write instead."""
    new, factor, how = RENAMED[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    converted = f" = {value * factor!r}" if isinstance(value, (int, float)) and number else ""
    return (
        f"{key} is now {new} ({how}): write {new.rpartition('.')[2]}{converted} in the "
        f"[{new.partition('.')[0]}] table (or --set {new}=...)"
    )


def known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config model (for "did you mean ...?" hints)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(known_keys(ann, prefix + name + "."))
    return keys


def dump_toml(cfg: EchoConfig) -> str:
    """Resolved config as TOML (written into every run folder)."""

    def fmt(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {fmt(x)}' for k, x in v.items()) + "}"
        return repr(v)

    out = []
    data = cfg.model_dump()
    for k, v in data.items():
        if not isinstance(v, dict) and v is not None:
            out.append(f"{k} = {fmt(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            out.append(f"\n[{k}]")  # TOML has no null: an unset key is left out
            out.extend(f"{kk} = {fmt(vv)}" for kk, vv in v.items() if vv is not None)
    return "\n".join(out) + "\n"


def differences(cfg: EchoConfig) -> list[tuple[str, object, object]]:
    """(dotted key, value, default) for every setting where ``cfg`` differs from the defaults
    (``EchoConfig()``, docs/config.md), in the config's order. A run's behaviour is the
    defaults plus these: the learner prints them at start (issue 56: the quickstart's
    ``learner.beta = 0.1`` lives in its file, and a config written from scratch starts from
    0.0 without a word). Adapter presets are left out (what the task gets is
    ``adapter.options``); a dict-valued setting counts as one key."""

    def flat(data: dict[str, object], prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in data.items():
            key = prefix + k
            if key == "adapter.presets":
                continue
            if isinstance(v, dict) and key != "adapter.options":
                out.update(flat(v, key + "."))
            else:
                out[key] = v
        return out

    have, default = flat(cfg.model_dump()), flat(type(cfg)().model_dump())
    return [(k, v, default.get(k)) for k, v in have.items() if v != default.get(k)]


def say_differences(cfg: EchoConfig, limit: int = 12) -> str:
    """One line: how many settings differ from the defaults, the first ``limit`` of them."""
    diff = differences(cfg)
    if not diff:
        return "this config is the defaults (docs/config.md)"
    shown = ", ".join(f"{k} = {v!r} (default {d!r})" for k, v, d in diff[:limit])
    more = (
        f", and {len(diff) - limit} more (config.toml in the run folder)"
        if len(diff) > limit
        else ""
    )
    return (
        f"this config differs from the defaults (docs/config.md) in {len(diff)} keys: {shown}{more}"
    )
