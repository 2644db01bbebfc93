"""``msa-fed ARGS`` run in this process: what a test that only checks a command's output and exit
status needs, without the seconds a new interpreter costs to import numpy, gRPC and torch.

Where the process boundary is the thing tested (a server that must bind and stop on a signal, a
job driver with its own Ray, "the config error comes before any heavy import") the tests start a
real process instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from pathlib import Path


def run_cli(*args, cwd: str | os.PathLike | None = None) -> tuple[int, str, str]:
    """``msa_fed.cli.main(args)`` as ``python -m msa_fed.cli ARGS`` would run it: (exit status,
    stdout, stderr).  An uncaught exception becomes exit status 1 with its traceback on stderr, as
    the interpreter would print it; argparse's exits keep their status.  The working directory,
    the environment and the root logger are restored afterwards."""
    from msa_fed.cli import main

    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    here = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    rc = exc.code or 0
                else:
                    print(exc.code, file=err)
                    rc = 1
            except Exception:  # noqa: BLE001 - what the interpreter does with an uncaught exception
                traceback.print_exc(file=err)
                rc = 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return int(rc), out.getvalue(), err.getvalue()


def registry_serve_argv(db, listen: str = "127.0.0.1:0", log_level: str = "WARNING", *extra: str) -> list[str]:
    """The command line of ``msa-fed registry serve`` in a new interpreter: the database ``db``,
    plaintext on loopback at ``listen``, logging at ``log_level``, then ``extra``."""
    return [
        sys.executable,
        "-m",
        "msa_fed.cli",
        "registry",
        "serve",
        "--db",
        str(db),
        "--listen",
        listen,
        "--insecure",
        "--log-level",
        log_level,
        *extra,
    ]
