"""``echo-worker`` on a device ``--slowdown`` times slower than this machine's: volunteers'
GPUs differ several-fold, and one 2-core machine has only one kind. benchmarks/affinity_real.py
runs its slow workers this way.

    python -m labs.slow_device --slowdown 3 join LINE --id w1 ...

The worker is the installed one; only its backend's ``generate`` is wrapped (the engine's and
the transformers backend's, whichever the run uses; the engine's fallback to the other counts
once): before each call it waits ``(slowdown - 1)`` times the previous call's own duration, so
a rollout takes about ``slowdown`` times as long and the wait holds no CPU (as a slower GPU's
time holds none of the host's). The wait ends early when the call's ``stop`` is set, and the
call then cuts at once, as a slow device stopped mid-rollout would: a stop that lands in the
wait still finds the rollout unfinished. The runtime carries no slowdown setting of its own.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from typing import Any

_inside = threading.local()  # a wrapped call under way on this thread (the outer one sleeps)


def slowed(generate: Any, slowdown: float) -> Any:
    last = [0.0]  # the previous call's own duration

    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):  # the engine's fallback to generate: counted once
            return generate(*args, **kwargs)
        # Backend.generate(self, groups, max_new_tokens, temperature, stop=None, tail=0.0)
        stop = kwargs.get("stop", args[4] if len(args) > 4 else None)
        wait = (slowdown - 1.0) * last[0]
        if stop is not None:
            stop.wait(wait)
        else:
            time.sleep(wait)
        _inside.depth = 1
        try:
            t0 = time.perf_counter()
            out = generate(*args, **kwargs)
            last[0] = time.perf_counter() - t0
        finally:
            _inside.depth = 0
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
    from echo_rl.cli.worker import main as echo_worker
    from echo_rl.worker.backends.engine import EngineBackend
    from echo_rl.worker.backends.transformers import TransformersBackend

    for cls in (EngineBackend, TransformersBackend):
        cls.generate = slowed(cls.generate, args.slowdown)  # type: ignore[method-assign]
    return echo_worker(rest)


if __name__ == "__main__":
    sys.exit(main())
