"""`python -m workbench`: see `workbench.cli`."""

import sys

from workbench.cli import main

if __name__ == "__main__":  # not in `plan --jobs`'s spawned workers, which import it again
    sys.exit(main())
