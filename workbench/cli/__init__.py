"""Command line: `python -m workbench COMMAND ... [--json]` (the `workbench` script).

Entry points: `main(argv)` (`workbench.cli.run`) and `build_parser()` (`workbench.cli.parser`).
Each command group is a module whose `cmd_*(args)` returns a result that knows its JSON and
what a person reads (`workbench.cli.report`); the flags they share are read and checked in
`workbench.cli.args`. With `--json` every command prints exactly one JSON object on stdout;
errors print one line on stderr and exit with status 2.
"""

from workbench.cli.parser import build_parser
from workbench.cli.run import main

__all__ = ["build_parser", "main"]
