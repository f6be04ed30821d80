"""How the learner's step spans devices: one process, or FSDP2 under torchrun.

Picked from the environment torchrun sets (``WORLD_SIZE > 1``); only rank 0 runs the control
plane, the buffer and publication, the other ranks follow its commands (``learner.follower``).
"""

from __future__ import annotations

import os

from learner.parallel.base import Parallel
from learner.parallel.single import Single


def make_parallel() -> Parallel:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from learner.parallel.fsdp2 import FSDP2  # late: initialises torch.distributed

        return FSDP2()
    return Single()


__all__ = ["Parallel", "Single", "make_parallel"]
