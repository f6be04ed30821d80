"""Learning plane: the learner process, GRPO steps, checkpoints, snapshot publication and
held-out evaluation. The server it serves the fleet with is ``echo_rl.control``."""
