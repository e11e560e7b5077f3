"""Call ``hyperpar.cli.main`` in-process and collect the exit code and what it printed."""

from __future__ import annotations

import pytest

from hyperpar.cli import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); a ``SystemExit("message")`` counts as code 1 with that message."""
    try:
        code = main(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            out, err = capsys.readouterr()
            return 1, out, err + exc.code
        code = 0 if exc.code is None else int(exc.code)
    out, err = capsys.readouterr()
    return code, out, err
