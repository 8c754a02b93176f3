"""The README and docs/ link only to files that exist, and the README's walkthrough uses real commands."""
from __future__ import annotations

import re
from pathlib import Path

from ple_prep.cli import cli
from scripts.cli_reference import command_helps

ROOT = Path(__file__).resolve().parent.parent


def test_docs_links_point_at_files():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def test_docs_readme_walkthrough_commands_exist():
    commands = {path for path, _ in command_helps(cli)}
    used = set(re.findall(r"^(ple-prep [a-z-]+(?: merge)?)", (ROOT / "README.md").read_text(), flags=re.M))
    assert used and used <= commands, f"README uses commands that do not exist: {used - commands}"
    assert {"ple-prep profile", "ple-prep convert", "ple-prep verify", "ple-prep inspect",
            "ple-prep bench"} <= used


def test_docs_readme_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    unlinked = [f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md"))
                if f"](docs/{page.name})" not in readme]
    assert not unlinked, f"add these to the README's Documentation list: {unlinked}"


def test_comments_point_at_files_in_the_repository():
    # Comments and docstrings say why and point at docs/; issues and outside notes are no
    # reader's context. Data paths such as /work/bigdata/issue4 are not references.
    pattern = re.compile(r"\b(?:[Ii]ssue \d|spec section|\.\./shared|shared/spec)")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for folder in ("ple_prep", "tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line) and path.name != "test_docs.py"]
    assert not found, "\n".join(found)
