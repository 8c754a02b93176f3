"""Without its compiled helper ple-prep serves the same bytes, slower: it says so once, with the fix,
where serving starts (open_table, `ple-prep bench`); a build that has it says nothing."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
from support.environment import child_environment

from ple_prep.runtime import CompiledHelperMissing, compiled_helper_missing, open_table

# What an install without a C compiler leaves: the package without its two extension modules.
WITHOUT_HELPER = "import sys\nsys.modules['ple_prep.core._native'] = sys.modules['ple_prep.runtime._native'] = None\n"


def _without_helper(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_HELPER + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=child_environment())


def test_open_table_warns_once_without_the_helper(fp8_table):
    done = _without_helper(f"""
        import json, warnings
        from ple_prep.runtime import open_table
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with open_table({str(fp8_table)!r}) as table:
                    assert not table.compiled
        print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in caught]))
    """)
    assert done.returncode == 0, done.stderr
    caught = json.loads(done.stdout)
    assert len(caught) == 1, caught
    category, message, filename = caught[0]
    assert category == "CompiledHelperMissing" and filename == "<string>"  # the caller's open_table line
    assert message.startswith("ple-prep's compiled helper is not built (")
    assert "install a C compiler and the Python headers" in message and "reinstall ple-prep" in message


def test_bench_says_the_helper_is_missing(fp8_table):
    done = _without_helper(f"""
        from ple_prep.cli import cli
        cli(["bench", {str(fp8_table)!r}, "--prefill-requests", "1", "--decode-requests", "5", "--fio-seconds", "0"])
    """)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if line.startswith("note: ")]
    assert notes[0].startswith("note: ple-prep's compiled helper is not built")
    assert "install a C compiler" in notes[0]
    assert "CompiledHelperMissing" not in done.stderr  # said in the report, not as a warning's traceback line


def test_a_build_with_the_helper_says_nothing(fp8_table):
    if compiled_helper_missing() is not None:
        pytest.skip("the compiled helper is not built here")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledHelperMissing)
        with open_table(fp8_table) as table:
            assert table.compiled
