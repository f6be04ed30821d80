"""The entry layer of ``echo-rl``: command implementations that drive the planes (eval and
sample run a worker backend on a learner checkpoint; token/worker/workers read the learner's
security files). ``echo/`` is the shared base the planes import, so only ``echo/cli.py``,
``worker/cli.py`` and this package may import upward (tests/test_layers.py checks it)."""
