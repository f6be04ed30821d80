"""Labs: benchmark harnesses, network-namespace builders, fault-injecting proxies and other
test doubles that exercise Echo from outside.

Nothing in the runtime packages (echo, learner, worker, broadcast, dataplane, adapters,
provisioning) imports from here; labs import the runtime. The package is not part of the wheel a
volunteer installs: benchmarks and tests run it from a checkout (pytest puts the repository root
on sys.path, see ``pythonpath`` in pyproject.toml; scripts run as ``python -m labs.<name>``).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout labs/ lives in


def child_env() -> dict[str, str]:
    """The environment for a child started as ``python -m labs.<name>``: the checkout first on
    PYTHONPATH, so the child finds labs/ whatever its working folder (labs/ is not installed)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
