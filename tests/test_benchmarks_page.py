"""BENCHMARKS.md is the results page: short, answering first, and the one source of the docs' figures."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "BENCHMARKS.md").read_text()
QUOTING = ["README.md", "docs/SERVING.md", "docs/RUNTIME.md"]
NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A measured figure: a time, a rate, a ratio or a share, with its unit; "16 x 172 bytes" (a product)
# is not one.
FIGURE = re.compile(rf"(?<![\w.,-])({NUMBER})(?:\s*(?:-|to)\s*({NUMBER}))?"
                    rf"(?:\s*(ms|us|µs|s|MiB/s|GB/s|rows/s|tokens/s|IOPS)\b|(x)\b|(%))")


def _numbers(text: str) -> set[str]:
    return set(re.findall(NUMBER, text))


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_benchmarks_page_is_short():
    assert len(PAGE.splitlines()) < 250, "move older runs to docs/benchmark-history.md"


def test_benchmarks_page_answers_in_its_first_screen():
    first_screen = "\n".join(PAGE.splitlines()[:30])
    for question in ["Decode step", "4,096-token prefill chunk", "Cold rows against fio", "Convert speed",
                     "Convert memory", "Page reads per token", "Host lookup"]:
        assert question in first_screen, question
    headings = {_slug(line.lstrip("#")) for line in PAGE.splitlines() if line.startswith("## ")}
    anchors = set(re.findall(r"\]\(#([^)]+)\)", PAGE))
    assert anchors and anchors <= headings, f"links to missing headings: {anchors - headings}"


def test_benchmarks_page_speaks_to_users():
    # The notebook's language (trees, reviews, where the benchmark host kept its files) stays in
    # docs/benchmark-history.md.
    commit = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
    found = re.findall(rf"{commit}|/work/|\breview|\b[Ii]ssue \d|done-when", PAGE)
    assert not found, found


def test_docs_quote_only_figures_the_benchmarks_page_carries():
    carried = _numbers(PAGE)
    missing = []
    for name in QUOTING:
        text = (ROOT / name).read_text()
        for match in FIGURE.finditer(text):
            numbers = [number for number in match.groups()[:2] if number]
            if not all(number in carried for number in numbers):
                missing.append(f"{name}: {match.group(0)!r}")
    assert not missing, "quote BENCHMARKS.md's figures (or add the measurement there):\n" + "\n".join(missing)


def test_figure_pattern_sees_times_rates_ratios_and_shares():
    seen = [match.group(0) for match in FIGURE.finditer(
        "0.035-0.069 ms, 9.5 us, 1.04x, 687 MiB/s, 2,432,703 tokens/s, 0.78-0.84%, 16 x 172 bytes, 8,192 tokens")]
    assert seen == ["0.035-0.069 ms", "9.5 us", "1.04x", "687 MiB/s", "2,432,703 tokens/s", "0.78-0.84%"]


def test_docs_cite_headings_the_benchmarks_page_has():
    # `BENCHMARKS.md, "Host lookup"` sends a reader to a section: it must be there.
    headings = [" ".join(line.lstrip("#").split()).lower() for line in PAGE.splitlines() if line.startswith("## ")]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dangling = []
    for page in pages:
        if page.name == "benchmark-history.md":
            continue
        text = " ".join(page.read_text().split())
        for cited in re.findall(r'BENCHMARKS\.md\)?, "([^"]+)"', text):
            if not any(cited.lower() in heading for heading in headings):
                dangling.append(f"{page.relative_to(ROOT)}: {cited!r}")
    assert not dangling, f"no such heading in BENCHMARKS.md: {dangling}"
