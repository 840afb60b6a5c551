"""The command line's usage errors, as the CLI tests check them."""
from __future__ import annotations


def one_line_error(capsys) -> str:
    """The one line a refused command printed (no traceback), checked."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rollout-engine: error: ")
    return lines[0]
