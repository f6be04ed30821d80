"""``python -m provisioning.sim SCENARIO.toml ...``: the same command line as ``echo-rl sim``."""

import sys

from provisioning.sim.report import main

sys.exit(main(sys.argv[1:]))
