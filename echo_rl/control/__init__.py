"""Control plane: the learner's server and its parts. Who may connect and join (gate, sessions,
members), work leases and their journal, the intake of deliveries and what a failed check costs
(deliveries, audits, reputation), snapshot routes and relay probes, the fleet's books, and
``echo-rl doctor``. The learner process (``echo_rl.learner``) builds it beside its trainer."""
