"""The one check of a refused command: what every bad input must look like from the outside."""
from __future__ import annotations

from pathlib import Path


def assert_refused(result, folder: Path, *fragments: str, left: tuple[str, ...] | list[str] = ()) -> None:
    """A CliRunner result of bad input: exit 2, nothing on stdout, one `error: ...` line on stderr
    holding every fragment, no traceback, and `folder` holding only the files named in `left`."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert sorted(p.name for p in folder.iterdir()) == sorted(left), "a refused command left files behind"
