"""The owner is busy while a flag file exists (a game launcher's wrapper, a cron job)."""

from __future__ import annotations

from pathlib import Path

from echo_rl.worker.owner.base import OwnerSignal


class FileSignal(OwnerSignal):
    last_seen: str  # OwnerSignal's: what the last sample saw, for the log line

    def __init__(self, path: str, quiet_s: float = 30.0):
        super().__init__(quiet_s)
        self.path = Path(path)

    def sample(self) -> bool:
        busy = self.path.exists()
        self.last_seen = f"{self.path} exists" if busy else ""
        return busy
