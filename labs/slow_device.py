"""``echo-worker`` on a device ``--slowdown`` times slower than this machine's: volunteers'
GPUs differ several-fold, and one 2-core machine has only one kind. benchmarks/affinity_real.py
runs its slow workers this way.

    python -m labs.slow_device --slowdown 3 join LINE --id w1 ...

The worker is the installed one; only its backend's ``generate`` is wrapped: after each call
it sleeps ``(slowdown - 1)`` times the call's own duration, so a rollout takes ``slowdown``
times as long and the sleep holds no CPU (as a slower GPU's time holds none of the host's).
The runtime carries no slowdown setting of its own.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any


def slowed(generate: Any, slowdown: float) -> Any:
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        time.sleep((slowdown - 1.0) * (time.perf_counter() - t0))
        return out

    return wrapper


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m labs.slow_device", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--slowdown", type=float, required=True, help=">= 1: how many times slower")
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.slowdown < 1:
        ap.error(f"--slowdown {args.slowdown}: use 1 (this machine's speed) or more")
    from worker.backends.transformers import TransformersBackend
    from worker.cli import main as echo_worker

    TransformersBackend.generate = slowed(  # type: ignore[method-assign]
        TransformersBackend.generate, args.slowdown
    )
    return echo_worker(rest)


if __name__ == "__main__":
    sys.exit(main())
