"""Broadcast plane: snapshot format, chunk serving and fetching, topologies.

This package never imports torch: relays move bytes, they do not need a tensor library.
"""
