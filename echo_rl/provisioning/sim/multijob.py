"""Several RL jobs on one fleet of rollout workers: an event-driven simulation (heapq, not SimPy:
one event per request and per learner step keeps 1,000 workers x 40 minutes near 2 s a mode).

Each job has its own learner (steps of ``prompts_per_step`` whole groups, oldest version first,
admission ``u >= v - S`` and eviction by ``echo_rl.data.rules``, as the single-job simulator), its
own model (rollout rate, cold/warm load and snapshot sync times) and phases that change its
learner step time and rollout length. A job's gate is open while it has fewer than
``(S - kappa + 1) x prompts_per_step`` groups in flight plus buffered (at least one batch): S
versions' worth, less the kappa - 1 versions a snapshot already lags the learner when a worker
starts with it; more would only wait in the buffer to go stale (with kappa = max(1, S - 1) it
is the learner's default ``max_outstanding_groups``, 2 batches, for S >= 2). A worker generates
with the snapshot published when it starts (``u``), after loading the model if needed: free
when it is the model it last ran, ``warm_s`` if resident (at most K per worker, least recently
used evicted), else ``cold_s``; plus ``sync_s`` when a newer snapshot was published since it
last fetched that model.

Modes: ``dedicated`` (worker i serves only ``owner[i]``) and ``shared`` (a worker serves any job,
or with ``fleet.reach = "home"`` the K jobs of its co-execution set). A free worker takes, among
the open jobs whose model it holds, the one with the fewest workers against its weighted target
(``fleet.target_alpha`` x the workers its learner needs at its last step time); it stays on its
open current job unless that job is over target and another is under it by more than
``fleet.stickiness``; it cold-loads another model only for a job owed workers, else it idles.
With ``fleet.policy = "turns"`` a shared worker follows the real worker's policy instead
(echo_rl/worker/sharing.py ``Turns``): it is joined to every job (or, ``reach = "home"``, its K home
jobs); when free it serves, among its joined jobs that ask (gate open: work to hand out), the
one with the least device-seconds on this worker per unit of weight (per-worker books, as
``Turns`` keeps per device; generation and snapshot syncs count, model moves do not). K is then
the models on the device (LRU); every joined model, once loaded, stays in host memory: free if
on the device, ``warm_s`` if not, ``cold_s`` the first time. A gate that opens goes to an idle
joined worker, its model's holders first. Two variants, both implementable in the product:
``"turns-decay"`` decays each worker's books (``used x exp(-dt / fleet.turns_tau_s)``: recent
turns count, following phases); ``"turns-need"`` also multiplies each job's weight by its
learner's need, as a heartbeat ack could carry it: its capacity requirement (the heuristic's,
without alpha) over the workers it holds (at least one), at least 0.1; ``"turns-needfirst"``
serves the asking job with the highest need, ties (within 5 %) to the least decayed books per
weight (echo_rl/provisioning/sim/multijob_turns.py).
Workers are billed for the whole horizon in both modes: the fleet is a fixed, rented pool
(provisioning's release of idle workers is out of scope).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from echo_rl.data import rules
from echo_rl.data.rules import ReadyQueue
from echo_rl.provisioning.sim.multijob_scenario import JobSection, MultiScenario, PhaseSection
from echo_rl.provisioning.sim.multijob_turns import choose_turns

DONE, STEP = 0, 1  # event kinds: a worker's request finished, a learner step finished


@dataclass
class JobStats:
    steps: int = 0
    staleness_max: int = 0
    wait_s: float = 0.0  # learner waiting for a batch
    used_s: float = 0.0  # worker-seconds spent for this job (loads + generation)
    used_usd: float = 0.0  # the same seconds at each worker's price
    gen_s: float = 0.0
    switch_s: float = 0.0  # cold and warm model loads
    sync_s: float = 0.0  # fetching newer snapshots of a loaded model (dedicated pays it too)
    cold: int = 0
    warm: int = 0
    dropped_groups: int = 0
    bound_s: float = 0.0  # worker-seconds its trained groups need at mean speed (the bound)
    steps_bound: float = 0.0  # steps if its learner never waited
    held_per_minute: list[float] = field(default_factory=list)  # mean workers held, per minute


class JobRun:
    """One job's learner and work books."""

    def __init__(self, idx: int, spec: JobSection) -> None:
        self.idx, self.spec = idx, spec
        self.S, self.B, self.G = spec.staleness, spec.prompts_per_step, spec.group_size
        self.cap = max(1, self.S - spec.kappa + 1) * self.B
        self.t_last = spec.phase_at(0.0).t_train_s  # the learner's latest step time
        self._cycle, self._offset = spec.cycle_s, spec.phase_offset_s
        self._ends = [float(x) for x in np.cumsum([p.duration_s for p in spec.phases])]
        self.v = 0
        self.published = 0
        self.buffer: ReadyQueue[None] = ReadyQueue()
        self.in_flight = 0
        self.held = 0  # workers loading or generating for it
        self._area, self._t_held = 0.0, 0.0  # integral of held over time, up to _t_held
        self.training = False
        self.wait_from = 0.0
        self.st = JobStats()

    def phase(self, now: float) -> PhaseSection:
        """``spec.phase_at``, with the cycle's boundaries computed once (the hot loop)."""
        x = (now + self._offset) % self._cycle
        for p, end in zip(self.spec.phases, self._ends, strict=True):
            if x < end:
                return p
        return self.spec.phases[-1]

    def required(self, now: float, mean_speed: float) -> float:
        """Its capacity requirement: workers that keep its learner busy at its last step time
        and the current rollout length."""
        gen = self.B * self.G * self.phase(now).gen_scale / (self.spec.mu * mean_speed)
        return gen / self.t_last

    def need(self, now: float, mean_speed: float, alpha: float) -> float:
        """Workers held over the weighted target (below 1: it is owed workers)."""
        return self.held / (alpha * self.required(now, mean_speed) * self.spec.weight)

    def hold(self, now: float, delta: int) -> None:
        self._area += self.held * (now - self._t_held)
        self.held += delta
        self._t_held = now

    def minute_mark(self, t: float) -> None:
        """Close the minute ending at t (no held change since ``_t_held`` <= t)."""
        area = self._area + self.held * (t - self._t_held)
        self.st.held_per_minute.append((area - sum(self.st.held_per_minute) * 60.0) / 60.0)

    def free_slots(self) -> int:
        return rules.room(self.cap, self.in_flight, len(self.buffer))

    def deliver(self, g: int, u: int) -> None:
        self.in_flight -= g
        if rules.admission(u, self.v, self.S) == rules.OK:
            self.buffer.push(u, count=g)
        else:
            self.st.dropped_groups += g

    def start_step(self, now: float) -> float | None:
        """Take a batch and return the step's duration, or None when it must wait."""
        if self.training or len(self.buffer) < self.B:
            return None
        oldest = self.buffer.take(self.B, self.v)[0]
        s = self.v - oldest
        assert s <= self.S, f"job {self.spec.name}: staleness {s} > S={self.S}"
        self.st.staleness_max = max(self.st.staleness_max, s)
        self.st.wait_s += now - self.wait_from
        ph = self.phase(now)
        self.st.bound_s += self.B * self.G * ph.gen_scale / self.spec.mu
        self.training = True
        self.t_last = ph.t_train_s
        return ph.t_train_s

    def end_step(self, now: float) -> None:
        self.training = False
        self.wait_from = now
        self.v += 1
        self.st.steps += 1
        if self.v % self.spec.kappa == 0:
            self.published = self.v
        self.st.dropped_groups += self.buffer.evict(self.v, self.S)[0]


class Workers:
    """Per worker: speed, price, the model it runs, its resident models (LRU) and their
    snapshot versions; and the idle index (by current model, by resident model)."""

    def __init__(self, sc: MultiScenario, owner: list[int], speed: np.ndarray) -> None:
        f = sc.fleet
        self.n, self.K = f.workers, f.resident_models
        self.speed = speed.tolist()
        self.price = [f.price] * self.n
        self.cur = list(owner)  # every worker starts with its dedicated job's model loaded
        J = len(sc.jobs)
        self.home = home_sets(owner, J, self.K) if f.reach == "home" and J > self.K else None
        self.turns = f.policy.startswith("turns")
        # The variants of "turns": the books decay with time constant tau (recent turns).
        self.tau = f.turns_tau_s if f.policy not in ("target", "turns") else None
        self.book_t = [0.0] * self.n  # when worker i's books were last decayed
        # "target": resident = in host memory (home sets loaded before the run). "turns":
        # resident = on the device, LRU; host memory holds every model loaded once.
        self.resident: list[list[int]] = (
            [list(h) for h in self.home] if self.home and not self.turns else [[j] for j in owner]
        )
        self.res_ver: list[dict[int, int]] = [dict.fromkeys(r, 0) for r in self.resident]
        self.joined = self.home or [list(range(J))] * self.n  # the jobs each worker joined
        self.used = [[0.0] * J for _ in range(self.n)]  # "turns": device-seconds per job
        self.idle_cur: list[dict[int, None]] = [{} for _ in range(J)]
        self.idle_res: list[dict[int, None]] = [{} for _ in range(J)]
        self.idle_join: list[dict[int, None]] = [{} for _ in range(J)]  # "turns" only
        self.idle = [False] * self.n

    def charge(self, i: int, j: int, seconds: float, now: float) -> None:
        """Turns' books: ``seconds`` of worker i's device to job j, older turns decayed first
        (``used * exp(-dt / tau)``; one stamp per worker, so the decay never reorders its jobs
        and choosing needs no decay)."""
        row = self.used[i]
        if self.tau is not None and now > self.book_t[i]:
            f = math.exp(-(now - self.book_t[i]) / self.tau)
            for k in range(len(row)):
                row[k] *= f
            self.book_t[i] = now
        row[j] += seconds

    def set_idle(self, i: int) -> None:
        self.idle[i] = True
        self.idle_cur[self.cur[i]][i] = None
        for r in self.resident[i]:
            if r != self.cur[i]:
                self.idle_res[r][i] = None
        if self.turns:
            for k in self.joined[i]:
                self.idle_join[k][i] = None

    def clear_idle(self, i: int) -> None:
        self.idle[i] = False
        self.idle_cur[self.cur[i]].pop(i, None)
        for r in self.resident[i]:
            self.idle_res[r].pop(i, None)
        if self.turns:
            for k in self.joined[i]:
                self.idle_join[k].pop(i, None)

    def load(self, i: int, job: JobRun) -> tuple[float, float, str]:
        """Worker i switches to (or stays on) ``job``: seconds loading the model, seconds
        fetching a newer snapshot, and which load."""
        j, spec = job.idx, job.spec
        res = self.resident[i]
        if self.turns:
            return self._load_turns(i, job)
        if self.cur[i] == j:
            kind, t = "none", 0.0
        elif j in res:
            kind, t = "warm", spec.warm_s
            res.remove(j)
        else:
            kind, t = "cold", spec.cold_s
            if len(res) >= self.K:
                self.res_ver[i].pop(res.pop(0))  # least recently used leaves host memory
            self.res_ver[i][j] = job.published  # a cold load fetches the newest snapshot
        if j not in res:
            res.append(j)
        sync = 0.0
        if self.res_ver[i][j] < job.published:
            sync = spec.sync_s
            self.res_ver[i][j] = job.published
        self.cur[i] = j
        return t, sync, kind

    def _load_turns(self, i: int, job: JobRun) -> tuple[float, float, str]:
        """``Turns._take``: a model on the device costs nothing; another evicts the least
        recently used one to host memory and comes back from there (warm) or, the first
        time, from disk (cold, the newest snapshot)."""
        j, spec, res, ver = job.idx, job.spec, self.resident[i], self.res_ver[i]
        if j in res:
            kind, t = "none", 0.0
            res.remove(j)
        else:
            if len(res) >= self.K:
                res.pop(0)  # parked: stays in host memory, its snapshot version kept
            kind, t = ("warm", spec.warm_s) if j in ver else ("cold", spec.cold_s)
            if kind == "cold":
                ver[j] = job.published
        res.append(j)
        sync = 0.0
        if ver[j] < job.published:
            sync = spec.sync_s
            ver[j] = job.published
        self.cur[i] = j
        return t, sync, kind


def home_sets(owner: list[int], J: int, K: int) -> list[list[int]]:
    """Each worker's co-execution set: its own job and K - 1 others, rotated over the owner's
    workers so that every other job reaches an equal share of them (own job last: loaded)."""
    seen = [0] * J
    out = []
    for o in owner:
        others = [k for k in range(J) if k != o]
        c = seen[o]
        seen[o] += 1
        out.append([others[(c + m) % len(others)] for m in range(K - 1)] + [o])
    return out


class MultiSim:
    """One mode of one scenario: ``MultiSim(sc, owner, shared).run()`` fills each job's stats."""

    def __init__(self, sc: MultiScenario, owner: list[int], speed: np.ndarray, shared: bool):
        self.sc, self.shared = sc, shared
        self.owner = owner
        self.jobs = [JobRun(k, j) for k, j in enumerate(sc.jobs)]
        self.w = Workers(sc, owner, speed)
        self.mean_speed = float(np.mean(speed))
        self.rng = np.random.default_rng([sc.run.seed, 1])  # request jitter only
        self._jit: list[float] = []
        self._jit_pos = 0
        self.H = sc.run.horizon_s
        self.gpr = sc.fleet.groups_per_request
        self.now = 0.0
        self.events: list[tuple[float, int, int, int, int, int]] = []
        self._next_minute = 60.0
        self.seq = 0

    def _push(self, t: float, kind: int, a: int, b: int = 0, c: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b, c))

    def _allowed(self, i: int) -> list[JobRun]:
        if not self.shared:
            return [self.jobs[self.owner[i]]]
        return [self.jobs[k] for k in self.w.joined[i]]

    def _choose(self, i: int) -> JobRun | None:
        """The job a free worker serves next, or None (every job it may serve is gated).
        A cold load (60 s or more) evicts a model the worker may be asked for next, so it
        serves a resident model's job when one is open, and cold-loads another only for a job
        owed workers (else it idles)."""
        if self.shared and self.w.turns:
            return choose_turns(self, i)
        ok = [j for j in self._allowed(i) if j.free_slots() > 0]
        if not ok:
            return None
        res = self.w.resident[i]
        f = self.sc.fleet
        warm = [j for j in ok if j.idx in res]
        if not warm:  # cold: only for a job owed workers, the neediest
            most, k = min((j.need(self.now, self.mean_speed, f.target_alpha), j.idx) for j in ok)
            return self.jobs[k] if most < 1 else None
        if len(warm) == 1:
            return warm[0]
        need = {j.idx: j.need(self.now, self.mean_speed, f.target_alpha) for j in warm}
        cur = self.w.cur[i]
        # A switch costs a load: stay on an open job unless it is over its target and another
        # is under it by more than the margin.
        low = min(n for k, n in need.items() if k != cur)
        if cur in need and (need[cur] <= 1 or low * (1 + f.stickiness) >= 1):
            return self.jobs[cur]
        return min(warm, key=lambda j: (need[j.idx], j.idx))

    def _jitter(self) -> float:
        sigma = self.sc.fleet.duration_sigma
        if not sigma:
            return 1.0
        if self._jit_pos >= len(self._jit):  # mean-one lognormal, drawn 64k at a time
            self._jit = self.rng.lognormal(-sigma * sigma / 2, sigma, 65536).tolist()
            self._jit_pos = 0
        self._jit_pos += 1
        return self._jit[self._jit_pos - 1]

    def _start(self, i: int, job: JobRun) -> None:
        now, st = self.now, job.st
        switch_s, sync_s, kind = self.w.load(i, job)
        load_s = switch_s + sync_s
        if kind == "cold":
            st.cold += 1
        elif kind == "warm":
            st.warm += 1
        g = min(self.gpr, job.free_slots())
        ph = job.phase(now)
        gen = g * job.G * ph.gen_scale / (self.w.speed[i] * job.spec.mu) * self._jitter()
        end = now + load_s + gen
        # Seconds past the horizon are not part of the measured window.
        used = min(end, self.H) - now
        st.used_s += used
        st.used_usd += self.w.price[i] * used / 3600.0
        st.switch_s += min(switch_s, used)
        st.sync_s += min(sync_s, used - min(switch_s, used))
        st.gen_s += used - min(load_s, used)
        self.w.charge(i, job.idx, end - now - switch_s, now)  # Turns' books: not the move
        job.in_flight += g
        job.hold(now, +1)
        self._push(end, DONE, i, job.idx, g * 1_000_000 + job.published)

    def _serve(self, i: int) -> None:
        job = self._choose(i)
        if job is None:
            self.w.set_idle(i)
        else:
            self._start(i, job)

    def _fill(self, job: JobRun) -> None:
        """The job's gate opened: hand its free slots to idle workers, cheapest switch first."""
        w = self.w
        while job.free_slots() > 0:
            i = self._idle_for(job)
            if i is None:
                return
            w.clear_idle(i)
            self._start(i, job)

    def _idle_for(self, job: JobRun) -> int | None:
        w = self.w
        if w.idle_cur[job.idx]:
            return next(iter(w.idle_cur[job.idx]))
        if not self.shared:  # a dedicated worker's current job is its own: none is idle
            return None
        if w.idle_res[job.idx]:  # holds the model: a warm switch (home sets: only these)
            return next(iter(w.idle_res[job.idx]))
        if w.turns:  # any idle worker joined to it (warm from host memory, or a first load)
            return next(iter(w.idle_join[job.idx]), None)
        if w.home is None:
            for pool in w.idle_cur:
                if pool:
                    return next(iter(pool))
        return None

    def _try_step(self, job: JobRun) -> None:
        dt = job.start_step(self.now)
        if dt is not None:
            self._push(self.now + dt, STEP, job.idx)
            self._fill(job)

    def _minutes_until(self, t: float) -> None:
        """Close every minute of the held-workers record that ends by t (for the plot)."""
        while self._next_minute <= min(t, self.H):
            for job in self.jobs:
                job.minute_mark(self._next_minute)
            self._next_minute += 60.0

    def run(self) -> list[JobStats]:
        # Each worker picks as a freed worker would: its own model's job first (all equally
        # unserved at t=0), so no worker starts with a cold load.
        for i in range(self.w.n):
            self._serve(i)
        while self.events and self.events[0][0] <= self.H:
            t, _, kind, a, b, c = heapq.heappop(self.events)
            self._minutes_until(t)
            self.now = t
            job = self.jobs[b if kind == DONE else a]
            if kind == DONE:
                job.hold(t, -1)
                job.deliver(c // 1_000_000, c % 1_000_000)
                self._try_step(job)
                self._fill(job)
                self._serve(a)
            else:
                job.end_step(t)
                self._try_step(job)
                self._fill(job)
        self._minutes_until(self.H)
        for job in self.jobs:
            job.st.steps_bound = steps_if_never_waiting(job.spec, self.H)
        return [j.st for j in self.jobs]


def steps_if_never_waiting(spec: JobSection, horizon: float) -> float:
    """The learner's own ceiling: steps in the horizon if every batch were ready at once."""
    t, n = 0.0, 0
    while True:
        t += spec.phase_at(t).t_train_s
        if t > horizon:
            return float(n)
        n += 1
