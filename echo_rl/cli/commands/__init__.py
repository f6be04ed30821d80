"""The entry layer of ``echo-rl``: command implementations that drive the planes (eval and
sample run a worker backend on a learner checkpoint; token/worker/workers read the learner's
security files). ``echo_rl/core/`` is the shared base the planes import, so only ``echo_rl/cli/rl.py``,
``echo_rl/cli/worker.py`` and this package may import upward (tests/test_layers.py checks it)."""
