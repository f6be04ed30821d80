"""``python -m echo_rl ...`` is ``echo-rl ...`` (``torchrun -m echo_rl learn CONFIG``)."""

import sys

from echo_rl.cli.rl import main

if __name__ == "__main__":
    sys.exit(main())
