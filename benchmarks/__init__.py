"""Benchmark and drill scripts, each run as a file (``python benchmarks/<name>.py``). A package
only so that tests import what they check as ``benchmarks.<name>`` (pytest puts the checkout on
sys.path) instead of editing sys.path; the runtime packages never import it."""
