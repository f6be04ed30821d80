"""What machine a result was measured on: stored next to every benchmark and run summary."""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def machine_info() -> dict[str, Any]:
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
        "platform": platform.platform(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "mem_gib": mem, "python": sys.version.split()[0],
        "torch": ver("torch"), "transformers": ver("transformers"), "pyzmq": ver("pyzmq"),
        "hostname": platform.node(),
    }
