"""cli: the ``buildkit`` command, one module per command group. May import every layer."""

from buildkit.cli.main import entry, main

__all__ = ["entry", "main"]
