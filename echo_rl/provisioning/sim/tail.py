"""Sample lengths within a simulated request, and the long-tail cut (docs/scheduling.md).

Without a length model (``rollout.length_mean = 0``) a request lasts ``groups x G / mu`` times
a jitter. With one, each sample's length is geometric with mean ``length_mean``, cut at
``length_cap`` tokens, and a request lasts as many decode steps as its longest sample (the
transformers backend computes every row of the batch until the call ends). A decode step of
``rows`` rows costs ``(1 - r) + r * rows / (groups x G)`` with ``r = rollout.decode_row_cost``:
0 when a step costs the same however many rows it has (a GPU's memory-bound decode), 1 when
its cost is in proportion to them (a CPU). Costs are scaled per worker so that a request's
mean duration without a cut is still ``groups x G / mu``: the length model changes where the
time goes, not the worker's rate.

Two kinds of task (``rollout.long_share`` > 0): a group is a long task with that chance (its
samples' mean ``length_mean``) or a short one (mean ``rollout.short_mean``); the scaling above
is over that mix drawn at random. With ``rollout.affinity``, which task a worker's request takes
is chosen by the learner's own picker (``echo_rl.data.affinity.Picker``) from the worker's speed rank
in the fleet and each task's expected length (its kind's mean): long tasks to fast workers.

With ``rollout.tail_cut = x``, as ``worker.tail_cut``: a request stops at the first step where
a share ``x`` of its fresh samples ended and every carried sample ended; the fresh groups
with a sample still running are carried, with what is left of each sample, into the worker's
next request. A carried group keeps the version it started with (its oldest tokens').
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from echo_rl.provisioning.sim.scenario import RolloutSection


@dataclass
class Carried:
    """One worker's groups cut in their tail: what is left of each sample, per group."""

    left: list[np.ndarray] = field(default_factory=list)
    version: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.left)

    def clear(self) -> int:
        n = len(self.left)
        self.left, self.version = [], []
        return n


class Lengths:
    """Decode steps per request, the groups it completes, and each worker's carry."""

    def __init__(
        self,
        ro: RolloutSection,
        group_size: int,
        rng: np.random.Generator,
        n: int,
        speed: list[float] | None = None,
    ):
        self.on = ro.length_mean > 0
        self.cut, self.cap, self.G, self.rng = ro.tail_cut, ro.length_cap, group_size, rng
        self.row_cost, self.rows = ro.decode_row_cost, ro.groups_per_request * group_size
        self.p = 1.0 / max(ro.length_mean, 1.0)
        self.p_short = 1.0 / max(ro.short_mean, 1.0)
        self.long_share = ro.long_share if ro.long_share and ro.short_mean else 1.0
        self.carry = [Carried() for _ in range(n)]
        self.mean_steps = 1.0
        self.tasks = Tasks(ro, rng, speed or [1.0] * n) if self.long_share < 1.0 else None
        if self.on:  # (no draws otherwise: scenarios without lengths keep their random stream)
            n_req = 4096 * ro.groups_per_request
            kinds = None if self.tasks is None else self.rng.random(n_req) < self.long_share
            draws = self._lengths(
                n_req * group_size if kinds is None else np.repeat(kinds, group_size)
            )
            per_request = draws.reshape(4096, -1).max(axis=1)
            self.mean_steps = float(per_request.mean())  # E[longest sample of a request]

    def _lengths(self, long: int | np.ndarray) -> np.ndarray:
        """Sample lengths: ``long`` of one kind of task, or one per entry of a mask (True: a
        long task's sample)."""
        if isinstance(long, int):
            return np.minimum(self.rng.geometric(self.p, long), self.cap)
        return np.minimum(self.rng.geometric(np.where(long, self.p, self.p_short)), self.cap)

    def _fresh(self, i: int, g: int) -> np.ndarray:
        if self.tasks is None:
            return self._lengths(g * self.G).reshape(g, self.G)
        long = np.array([self.tasks.take(i) for _ in range(g)], dtype=bool)
        return self._lengths(np.repeat(long, self.G)).reshape(g, self.G)

    def request(self, i: int, g: int, u: int) -> tuple[float, list[tuple[int, int]]]:
        """Worker ``i`` generates ``g`` fresh groups under version ``u`` with its carry:
        (decode steps as a share of a mean uncut request, [(version, groups)] completed)."""
        fresh = self._fresh(i, g)
        c = self.carry[i]
        longest_carried = max((int(x.max()) for x in c.left), default=0)
        if not fresh.size:  # nothing granted: the carry alone
            t = longest_carried
        elif self.cut:
            k = max(1, math.ceil(self.cut * fresh.size))
            t = max(int(np.sort(fresh, axis=None)[k - 1]), longest_carried)
        else:
            t = max(int(fresh.max()), longest_carried)
        rows = fresh.size + sum(int((x > 0).sum()) for x in c.left)
        cost = t * (1.0 - self.row_cost + self.row_cost * rows / self.rows)
        done: dict[int, int] = {}
        for v in c.version:  # every carried sample ends by t
            done[v] = done.get(v, 0) + 1
        c.clear()
        for row in fresh:
            if int(row.max()) <= t:
                done[u] = done.get(u, 0) + 1
            else:
                c.left.append(np.maximum(row - t, 0))
                c.version.append(u)
        return cost / self.mean_steps, sorted(done.items())


class Tasks:
    """The stream of task kinds and the picker that routes them: the learner's own
    (``echo_rl.data.affinity.Picker``), each task's expected length its kind's mean, each worker's
    rank its speed's among the fleet's (0 the slowest, 1 the fastest)."""

    def __init__(self, ro: RolloutSection, rng: np.random.Generator, speed: list[float]):
        from echo_rl.data.adapter import Prompt
        from echo_rl.data.affinity import LengthBook, Picker

        means = {True: max(1, round(ro.length_mean)), False: max(1, round(ro.short_mean))}

        def stream() -> Iterator[Prompt]:
            while True:
                for long in rng.random(4096) < ro.long_share:
                    yield Prompt([int(long)], max_new_tokens=means[bool(long)])

        book = LengthBook() if ro.affinity else None
        self.picker = Picker(stream(), ro.affinity_window, book)
        order = np.argsort(np.argsort(np.asarray(speed), kind="stable"), kind="stable")
        self.rank = (order / max(1, len(speed) - 1)).tolist()

    def take(self, i: int) -> bool:
        """Worker ``i``'s next task: long?"""
        return bool(self.picker.take(self.rank[i]).prompt_ids[0])
