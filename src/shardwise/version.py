"""The version of shardwise (pyproject.toml says the same)."""

__version__ = "0.1.0"
