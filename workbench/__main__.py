"""`python -m workbench`: see `workbench.cli`. A Python without the workbench's dependencies
(torch, numpy, networkx: any but the `make lab` environment's) gets one line, not a
traceback."""

import sys

EXIT_USAGE = 2


def _run() -> int:
    try:
        from workbench.cli import main
    except ModuleNotFoundError as err:
        if (err.name or "workbench").partition(".")[0] == "workbench":
            raise
        print(
            f"error: No module named {err.name!r}: run the workbench from the set-up's environment "
            "(.venv/bin/python -m workbench, after make lab)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return main()


if __name__ == "__main__":  # not in `plan --jobs`'s spawned workers, which import it again
    sys.exit(_run())
