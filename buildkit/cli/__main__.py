from buildkit.cli.main import entry

entry()
