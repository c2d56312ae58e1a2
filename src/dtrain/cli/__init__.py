"""The `dtrain` command: `commands.py` runs a subcommand (`main`, the console script's
entry), `parser.py` builds every subcommand's parser without torch, `preflight.py` checks
a command line before any process starts.

A command: it imports the config, the launcher, the demo's flags and checks, the
checkpoint tools and the products' flags; nothing in the core imports it. Importing it
imports no torch.
"""

from dtrain.cli.commands import main
from dtrain.cli.parser import build_parser

__all__ = ["build_parser", "main"]
