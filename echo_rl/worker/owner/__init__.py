"""Owner first (docs/preemption.md): signals that the machine's owner needs it back.

``make_signal(kind, ...)`` picks one implementation by name: ``cpu`` (other processes' CPU
load), ``nvml`` (other processes on the GPU), ``file`` (a flag file the owner's tools create).
"""

from __future__ import annotations

from echo_rl.worker.owner.base import OwnerSignal

SIGNALS = ("auto", "cpu", "nvml", "file")


def make_signal(
    kind: str,
    *,
    quiet_s: float = 30.0,
    cpu_cores: float = 0.5,
    path: str = "",
    proc: str = "/proc",
    index: int = 0,
) -> OwnerSignal:
    """``path``: the flag file (``file``); ``proc``: where the CPU load is read (``cpu``);
    ``index``: the GPU watched (``nvml``)."""
    if kind == "auto":
        from echo_rl.worker.owner.nvml import nvml_available

        kind = "nvml" if nvml_available() else "cpu"
    if kind == "cpu":
        from echo_rl.worker.owner.cpu import CpuSignal

        return CpuSignal(quiet_s=quiet_s, cores=cpu_cores, proc=proc)
    if kind == "nvml":
        from echo_rl.worker.owner.nvml import NvmlSignal

        return NvmlSignal(quiet_s=quiet_s, index=index)
    if kind == "file":
        from echo_rl.worker.owner.file import FileSignal

        if not path:
            raise ValueError("--owner-signal file needs --owner-file PATH (the flag file)")
        return FileSignal(path, quiet_s=quiet_s)
    raise ValueError(f"unknown owner signal {kind!r}: use one of {SIGNALS}")
