"""The runtime's code says why, not how fast: no measured figure in a comment or docstring of its
Python (the figures live in BENCHMARKS.md), and every results heading a comment cites exists."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "ple_prep" / "runtime"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A time, a rate or a ratio: what a measurement gives (the results page's own pattern).
FIGURE = re.compile(rf"(?<![\w.,-])({NUMBER})(?:\s*(?:-|to)\s*({NUMBER}))?"
                    rf"(?:\s*(ms|us|µs|s|MiB/s|GB/s|rows/s|tokens/s|IOPS)\b|(x)\b)")
# The modules whose citations are checked: the device package and the read path's core.
CITING = [*sorted((RUNTIME / "device").glob("*.py")),
          *(RUNTIME / f"{name}.py" for name in ("direct", "footprint", "gather", "table", "tiers"))]
CITATION = re.compile(r'(BENCHMARKS\.md|docs/benchmark-history\.md),\s+"([^"]+)"')


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string of a module."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.startswith('"""')):
            found.append((token.start[0], token.string))
    return found


def _headings(page: Path) -> list[str]:
    return [" ".join(line.lstrip("#").split()) for line in page.read_text().splitlines() if line.startswith("#")]


def test_runtime_comments_carry_no_measured_figures():
    found = [f"{path.relative_to(ROOT)}:{line + text[:match.start()].count(chr(10))}: {match.group(0)!r}"
             for path in sorted(RUNTIME.rglob("*.py")) for line, text in _prose(path)
             for match in FIGURE.finditer(text)]
    assert not found, "move the figure to BENCHMARKS.md and cite its heading:\n" + "\n".join(found)


def test_runtime_comments_cite_headings_that_exist():
    pages = {"BENCHMARKS.md": _headings(ROOT / "BENCHMARKS.md"),
             "docs/benchmark-history.md": _headings(ROOT / "docs" / "benchmark-history.md")}
    cited, dangling = 0, []
    for path in CITING:
        for line, text in _prose(path):
            for page, heading in CITATION.findall(" ".join(text.split())):
                cited += 1
                if not any(found.startswith(heading) for found in pages[page]):
                    dangling.append(f"{path.relative_to(ROOT)}:{line}: {page}, {heading!r}")
    assert cited and not dangling, "\n".join(dangling)


def test_the_figure_pattern_sees_what_a_comment_would_quote():
    seen = [match.group(0) for match in FIGURE.finditer("5-15 us, 0.33 ms on 14, about 3x faster, 16 ids")]
    assert seen == ["5-15 us", "0.33 ms", "3x"]
