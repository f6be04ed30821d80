"""The commands: ``echo-rl`` (``echo_rl.cli.rl``) and ``echo-worker`` (``echo_rl.cli.worker``),
at the top of the house: they import the planes, nothing imports them. Each imports its heavy
libraries late, so ``--help`` is instant."""
