"""Optional dependencies, installed by extras (pyproject.toml): a volunteer's ``pip install
echo-rl`` brings what a worker and a learner run need, and nothing for the simulator, reports
or the poker sandbox. A command that needs a missing one says which extra brings it."""

from __future__ import annotations

import importlib.util

from echo_rl.core.errors import EchoError

# top-level module -> the extra that installs it
EXTRA_OF = {
    "scipy": "sim",
    "simpy": "sim",
    "matplotlib": "report",
    "pandas": "report",
    "pyarrow": "report",
    "pokerkit": "poker",
}


class MissingExtra(EchoError, RuntimeError):
    """A feature's optional package is not installed."""

    default_reason = "missing_extra"


def require(module: str, feature: str) -> None:
    """Raise MissingExtra naming the extra to install when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(missing_message(module, feature))


def missing_message(module: str, feature: str) -> str:
    extra = EXTRA_OF.get(module, "all")
    return (
        f"{feature} needs {module}, which is not installed: pip install 'echo-rl[{extra}]' "
        f"(make venv installs every extra)"
    )


def from_import_error(err: ModuleNotFoundError, feature: str) -> MissingExtra | None:
    """The MissingExtra for an ImportError of an optional package; None for any other module
    (a real bug, or a core dependency missing: let it show as it is)."""
    root = (err.name or "").split(".")[0]
    return MissingExtra(missing_message(root, feature)) if root in EXTRA_OF else None
