"""Discrete-event simulator of an Echo run (SimPy), on the project's own models.

``echo-rl sim SCENARIO.toml [--json FILE] [--plots DIR] [--set key=value ...]``
(or ``python -m echo_rl.provisioning.sim ...``). The scenario format is ``echo_rl.provisioning.sim.scenario``.

What runs, and what it reuses (no second copy of the logic):

* **Learner** (one SimPy process): step t trains on ``N = prompts x group_size`` rollouts taken
  from the replay buffer, oldest first, whole groups only, admissible iff ``u >= v - S``
  (docs/design.md §3, as ``echo_rl.data.buffer.ReplayBuffer``); it waits (``T_wait``) until enough are there,
  then trains ``T_train``; ``v += 1``; every ``kappa`` steps it publishes snapshot ``v``.
  Stale groups are dropped at admission and when the version moves, and counted. Work is
  handed out like ``echo_rl.control.work.WorkQueue``: at most ``max_outstanding_groups`` issued plus
  buffered, so the fleet cannot run far ahead (a worker that gets no grant waits).
* **Workers** (one SimPy process each, for the whole run): request ``groups_per_request``
  groups, generate them with the installed snapshot (duration ``groups x G / mu_i``, lognormal
  jitter), deliver them tagged with that version. By default a worker stops generating when a
  snapshot is published until it has installed it (what ``echo_rl/worker/agent.py`` does: it fetches
  in its work loop); ``rollout.generate_during_download`` keeps old-snapshot generation going.
* **Broadcast**: per publication, per-worker arrival times from ``echo_rl.broadcast.planner``:
  chains are planned with ``plan_chains`` and each worker at position ``j`` of a chain installs
  at ``predict_chain_s(M, c, rate, j + 1, latency)`` (the planner's chain rate and per-chunk
  pipeline formula), plus ``reload_s``; star-limited and star-unlimited use
  ``star_limited_s`` / ``star_unlimited_s`` per worker. ``T_bcast`` is the time until a fraction
  ``q`` of the recipients installed; ``lower_bound_s`` is reported beside it. Above
  ``broadcast.plan_max_peers`` recipients the planner (0.3 s for 1,000 heterogeneous peers here,
  once per publication) runs on *binned* peers: reachable workers sorted by relay
  rate are cut into contiguous blocks, each block is one synthetic peer with the block's
  slowest down and up rates, and each planned chain is expanded back into its blocks' workers.
  The chain rates are therefore the planner's (conservative: a block's slowest member); chain
  lengths and per-position times are the expanded ones. Unreachable workers are always planned
  individually.
* **Provisioning**: the initial active set comes from ``echo_rl.provisioning.selection`` (greedy,
  ours, exact) against ``alpha * mu_req`` with ``mu_req`` from ``echo_rl.provisioning.capacity`` and
  ``T_bcast`` predicted by the planner for that set (iterated to a fixed point), or random
  (the paper's "w/o cost" ablation), or all, or a fixed count. The closed loop is
  ``echo_rl.provisioning.controller.Controller`` itself, with ``env.now`` as its clock, fed what the
  control plane feeds it: no prior for a joiner, ``ready`` at its first work request, admitted
  records only with their generation seconds. It ticks every ``tick_s`` and its decisions are
  carried out; ``mu_req`` is recomputed after every step from the learner's T_train average
  and the latest ``T_bcast``. An activated worker pulls the current snapshot from a peer
  (``M / b_down``). Admission, eviction, take and grant sizes are ``echo_rl.data.rules``, the
  learner's own.
* **Churn**: per-worker leave/rejoin rates, or a trace CSV ``time_s,worker,event``. A leaver's
  in-flight groups are lost and re-issued, its chain children re-attach upstream (``reattach_s``,
  nothing restarts), and the controller forgets it after ``heartbeat_timeout_s``; a joiner
  pulls the current snapshot on activation.

Costs: a worker is billed while present and active (from activation, including its download,
until release or departure); the learner always. Cost of a step = learner price x step time +
the integral of the active workers' prices over the step, i.e. docs/design.md §4's
``(p_learner + sum c_i) * (T_train + T_wait) / 3600`` when the set does not change in the step.

Public API (``echo_rl.provisioning.sim.api``): ``run_scenario``, ``simulate`` (path or dict),
``simulate_fixed`` (sim-vs-reality); the command line is ``echo_rl.provisioning.sim.report.main``.

Files, by job: ``core.py`` (``Sim``: the learner, publications, the run, the result), the
books (``state.py``: who is present and active, the cost ledger, each worker's snapshots),
work grants and the workers' processes (``work.py``), provisioning and churn (``fleet.py``),
the broadcast model (``broadcast.py``), the report and command line (``report.py``), plots
(``plots.py``), the centralized baselines (``centralized.py``), the scenario format
(``scenario.py``), random fleets (``pools.py``) and the control plane's load model
(``control_load.py``). ``Sim`` composes these parts; each gets the books it acts on.
Several jobs sharing one fleet, against a dedicated split, is a separate, lighter model
(``multijob.py``, its scenarios ``multijob_scenario.py``, the comparison ``multijob_report.py``;
``benchmarks/sim_multirun.py``, docs/multirun.md).

This package uses ``echo_rl.provisioning.capacity``, ``selection`` and ``controller`` and
``echo_rl.data.rules``; nothing outside it imports it except the CLI, benchmarks and tests. Its
``__init__`` imports nothing, so the light modules (``control_load``) load without SimPy.
"""
