"""How the learner's step spans devices: one process, or FSDP2 under torchrun.

Picked from the environment torchrun sets (``WORLD_SIZE > 1``); only rank 0 runs the control
plane, the buffer and publication, the other ranks follow its commands (``learner.follower``).
The device comes from ``learner.device``, resolved once here (under torchrun rank r takes
``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import os

from learner.parallel.base import Parallel
from learner.parallel.single import Single


def make_parallel(device: str = "cpu") -> Parallel:
    from echo.models import resolve_device

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from learner.parallel.fsdp2 import FSDP2  # late: initialises torch.distributed

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return FSDP2(resolve_device(device, "learner.device", local_rank=local_rank))
    return Single(resolve_device(device, "learner.device"))


__all__ = ["Parallel", "Single", "make_parallel"]
