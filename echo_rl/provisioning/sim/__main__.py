"""``python -m echo_rl.provisioning.sim SCENARIO.toml ...``: the same command line as ``echo-rl sim``."""

import sys

from echo_rl.provisioning.sim.report import main

sys.exit(main(sys.argv[1:]))
