"""Echo: what every plane shares (config, wire schema, models, CLI)."""

__version__ = "0.1.0"
