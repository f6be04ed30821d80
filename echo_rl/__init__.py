"""Echo: RL post-training of LLMs with a data-center learner and a wide-area fleet of rollout
workers (ECHO-2). One import package; its subpackages, from the bottom of the house up:

* ``echo_rl.core``: config, wire schema, client, models and payloads, metrics and dashboard;
* ``echo_rl.broadcast`` (snapshots: manifests, chunks, relays, planner) and ``echo_rl.data``
  (the Data Plane: records, the adapter API, episodes, advantages, the replay buffer
  and its write-ahead log);
* ``echo_rl.adapters`` (the tasks shipped) and ``echo_rl.provisioning`` (capacity, selection,
  the provisioner, the simulator);
* ``echo_rl.control`` (the server workers talk to: sessions, the gate, work leases, intake of
  deliveries, audits, reputation, snapshot routes) and ``echo_rl.worker`` (rollouts, backends,
  relaying);
* ``echo_rl.learner`` (the learner process: training steps, checkpoints, publication, held-out
  evaluation), which builds the control server beside its trainer;
* ``echo_rl.cli``: the ``echo-rl`` and ``echo-worker`` commands, the only modules that may
  import every plane (tests/test_layers.py).
"""

__version__ = "0.1.0"
