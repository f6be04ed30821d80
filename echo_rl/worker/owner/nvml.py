"""Other processes on this worker's GPU, through NVML (``pip install nvidia-ml-py``): the owner
is busy while any process other than this worker holds the GPU (a game's graphics context or
another compute job)."""

from __future__ import annotations

import os

from echo_rl.worker.owner.base import OwnerSignal


def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return bool(pynvml.nvmlDeviceGetCount() > 0)
    except Exception:  # no library, no driver, no GPU: the cpu signal is used instead
        return False


class NvmlSignal(OwnerSignal):
    last_seen: str  # OwnerSignal's: what the last sample saw, for the log line

    def __init__(self, quiet_s: float = 30.0, index: int = 0):
        super().__init__(quiet_s)
        try:
            import pynvml
        except ImportError:
            raise ValueError("--owner-signal nvml needs NVML: pip install nvidia-ml-py") from None
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.me = os.getpid()

    def sample(self) -> bool:
        n = self.nvml
        procs = n.nvmlDeviceGetComputeRunningProcesses(
            self.handle
        ) + n.nvmlDeviceGetGraphicsRunningProcesses(self.handle)
        others = [p.pid for p in procs if p.pid != self.me]
        self.last_seen = f"GPU processes {others[:4]}" if others else ""
        return bool(others)
