"""Star-unlimited: the star whose learner uplink is not the bottleneck.

Same plan as ``star`` (every worker pulls from the learner); the two differ only in the
learner's uplink cap, which is applied by whoever shapes the links (benchmarks: the learner's
token bucket is left out). Kept as its own name so configs and benchmark results say which
baseline ran; its predicted time is ``planner.star_unlimited_s`` (``M/b``) against star's
``planner.star_limited_s`` (``max(M/b, N*M/U)``).
"""

from __future__ import annotations

from typing import ClassVar

from echo_rl.broadcast.topology.star import StarTopology


class StarUnlimitedTopology(StarTopology):
    uplink_capped: ClassVar[bool] = False  # benchmarks: do not shape the learner's uplink
