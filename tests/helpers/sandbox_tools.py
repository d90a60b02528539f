"""Tools for tests/test_sandbox.py: module-level functions, so the sandbox can load them from this file."""

import os

from polopt_lightning.sandbox.tools import untrusted


@untrusted
def where_am_i(tag: str) -> dict:
    """Says where the call ran.

    Args:
        tag: returned as given.
    """
    return {"tag": tag, "pid": os.getpid(), "cwd": os.getcwd(), "run": os.environ.get("SANDBOX_RUN"),
            "home": os.environ.get("HOME")}


@untrusted
def spin(seconds: float) -> str:
    """Busy for a while.

    Args:
        seconds: how long.
    """
    while True:
        pass
