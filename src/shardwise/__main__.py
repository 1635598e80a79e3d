"""`python -m shardwise ...` is the `shardwise` command."""

from .cli.main import entry

entry()
