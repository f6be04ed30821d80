"""How the learner's step spans devices: one process, or FSDP2 under torchrun.

Picked from the environment torchrun sets (``WORLD_SIZE > 1``); only rank 0 runs the control
plane, the buffer and publication, the other ranks follow its commands (``learner.follower``).
The device comes from ``learner.device``, resolved once here (under torchrun rank r takes
``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import logging
import os
import sys

from echo_rl.learner.parallel.base import Parallel
from echo_rl.learner.parallel.single import Single


def make_parallel(device: str = "cpu") -> Parallel:
    from echo_rl.core.models import resolve_device

    if under_torchrun():
        from echo_rl.learner.parallel.fsdp2 import FSDP2  # late: initialises torch.distributed

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return FSDP2(resolve_device(device, "learner.device", local_rank=local_rank))
    return Single(resolve_device(device, "learner.device"))


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_rank(code: int) -> None:
    """End a torchrun rank that has finished (its process group destroyed) without the
    interpreter's finalisation. There, gloo's worker threads are torn down in no set order and
    about one run in twelve aborted with "terminate called without an active exception"
    (SIGABRT) after all its work was done, which torchrun reports as the job failing
    (tests/test_torchrun.py). Logs and standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["Parallel", "Single", "exit_rank", "make_parallel", "under_torchrun"]
