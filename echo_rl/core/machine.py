"""What machine a result was measured on: stored next to every benchmark and run summary."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from echo_rl.core.jsontypes import JsonObject


def machine_info() -> JsonObject:
    """Platform, CPUs, memory, Python and the versions of the packages that set speed."""

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "mem_gib": mem,
        "python": sys.version.split()[0],
        "torch": ver("torch"),
        "transformers": ver("transformers"),
        "pyzmq": ver("pyzmq"),
        "hostname": platform.node(),
        "vllm": ver("vllm"),
        "gpu": _gpu(),
    }


def write_result(
    path: str | Path, fields: Mapping[str, object], *, indent: int = 2
) -> dict[str, object]:
    """A benchmark's ``--json`` file: its fields after the machine it ran on, so no figure is
    stored without the machine that measured it. Returns the document written."""
    doc: dict[str, object] = {"machine": machine_info(), **fields}
    Path(path).write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    return doc


def _gpu() -> str | None:
    """The CUDA device's name, when torch is already loaded (never imported just for this)."""
    torch = sys.modules.get("torch")
    try:
        return (
            torch.cuda.get_device_name()
            if torch is not None and torch.cuda.is_available()
            else None
        )
    except Exception:  # a broken driver must not cost the benchmark its result
        return None
