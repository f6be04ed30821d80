"""Task adapters shipped with Echo (found through the ``echo_rl.adapters`` entry points)."""
