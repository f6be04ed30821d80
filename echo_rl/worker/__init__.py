"""Rollout plane: the volunteer's process (``echo-worker join``)."""
