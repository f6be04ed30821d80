"""``echo-rl`` with the learner's write-ahead log on a slow disk (every fsync ``--fsync-delay-s``
longer): the control plane's load test (benchmarks/load_control.py) runs its learner this way.

    python -m labs.slow_disk --fsync-delay-s 0.05 learn CONFIG --run-dir RUN

The learner is the installed one; only the log class it builds is the slow-disk double
(``labs.doubles.SlowDiskLog``), so the runtime carries no disk-delay setting of its own.
"""

from __future__ import annotations

import argparse
import functools
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m labs.slow_disk", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--fsync-delay-s", type=float, required=True)
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    from echo_rl.cli.rl import main as echo_rl
    from echo_rl.learner import main as learner_main
    from labs.doubles import SlowDiskLog

    learner_main.BufferLog = functools.partial(SlowDiskLog, delay_s=args.fsync_delay_s)
    return echo_rl(rest)


if __name__ == "__main__":
    sys.exit(main())
