"""The `kvsnap` subcommands: each module adds its commands' parsers and runs them.

Only kvsnap/commands/cli.py imports this package (it builds the parser and dispatches); heavy
imports (mlx, mlx-lm, uvicorn, rich) stay inside the command functions.
"""
