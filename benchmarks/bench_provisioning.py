"""Provisioning benchmark: greedy (paper) and ours against the MILP optimum, plus the time of
one decision over 100,000 candidates. The implementation lives in ``labs.provisioning_bench``
(a lab, outside the runtime packages); this file is the by-path entry.

    python benchmarks/bench_provisioning.py [--pools 1000] [--json FILE]
    python -m benchmarks.bench_provisioning [...]        # from the repository root

Writes ``benchmarks/results/provisioning.json`` (with the machine it ran on) and prints a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from labs.provisioning_bench import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
