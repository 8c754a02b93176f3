"""Every command's help carries an example, and docs/CLI.md is the current --help of every command."""
from __future__ import annotations

from ple_prep.cli import cli
from ple_prep.cli_reference import REFERENCE_PATH, REGENERATE, command_helps, render


def test_help_every_command_has_an_example_of_itself():
    helps = dict(command_helps(cli))
    assert {"ple-prep", "ple-prep convert", "ple-prep verify", "ple-prep inspect"} <= set(helps)
    missing = []
    for path, text in helps.items():
        _, _, example = text.partition("Example:")
        # The example block runs to the next blank line; it must show this very command.
        example_lines = example.split("\n\n", 1)[0]
        if not example or path not in example_lines:
            missing.append(path)
    assert not missing, f"commands whose --help lacks an `Example:` block using them: {missing}"


def test_help_documents_exit_status(runner):
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "Exit status: 0 ok, 1 a check failed (verify), 2 bad input" in result.output


def test_cli_reference_is_current():
    expected = render(cli)
    actual = REFERENCE_PATH.read_text() if REFERENCE_PATH.exists() else ""
    stale = [path for path, _ in command_helps(cli) if f"## `{path}`\n" not in actual]
    assert not stale, f"docs/CLI.md lacks {stale}: run `{REGENERATE}`"
    assert actual == expected, f"docs/CLI.md is stale: run `{REGENERATE}`"
