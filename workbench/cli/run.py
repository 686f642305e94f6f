"""Running one command: parse, check the flags every command shares, run, print the result
(its JSON with `--json`, else what a person reads) or one line of error.

Entry point: `main(argv) -> exit status`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

from workbench.cli.args import check_common_args
from workbench.cli.parser import EXIT_USAGE, build_parser
from workbench.cli.report import Command, Result
from workbench.errors import WorkbenchError, torch_logs_held

__all__ = ["main"]


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While a `--json` command runs, whatever it prints (a user factory's print, a native
    library writing to file descriptor 1) goes to stderr: stdout holds only the JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: Python-level redirection is all there is
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workbench ARGV`: 0 when the command ran, 2 (one line on stderr) when not."""
    args = build_parser().parse_args(argv)
    run: Command = args.run
    try:
        with _stdout_to_stderr() if args.json else contextlib.nullcontext(), torch_logs_held():
            check_common_args(args)
            result: Result = run(args)
    except WorkbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as err:  # user code (a factory, a loss) called sys.exit mid-command
        print(
            f"error: {args.command} stopped: code it ran called sys.exit({err.code!r})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C, or user code raising it: one line, not a traceback
        print(f"error: {args.command} interrupted (KeyboardInterrupt)", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(result.to_json()) if args.json else result)
    return 0
