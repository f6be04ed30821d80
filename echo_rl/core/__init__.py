"""What every plane shares: config, wire schema, client, models and payloads, metrics and the
dashboard, the security primitives. Imports nothing else of Echo (tests/test_layers.py)."""
