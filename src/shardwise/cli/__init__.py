"""The `shardwise` command (`main`: launch, config, export, verify, report, plan, env), the
torchrun argument list and its run (`launch`), `shardwise plan` (`plan`) and `shardwise env`
(`env`)."""

from .main import build_parser as build_parser, entry as entry, main as main
