"""Learning plane: GRPO steps, the replay buffer, work hand-out and snapshot publication."""
