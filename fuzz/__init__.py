"""Fuzzing harness for Echo's decoders (docs/fuzzing.md); not installed with the package."""
