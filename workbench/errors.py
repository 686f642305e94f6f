"""The one exception users see: a clear, one-line message naming what to do instead.

Library code raises `WorkbenchError`; the CLI prints it and exits with status 2.
"""


class WorkbenchError(Exception):
    """Bad input or an unsupported model, explained in words rather than a torch traceback."""
