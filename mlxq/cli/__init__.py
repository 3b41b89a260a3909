"""The `mlxq` command line: one file per command group, wired in main.py."""
