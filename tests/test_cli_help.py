"""Every command's help carries an example, and docs/CLI.md is the current --help of every command."""
from __future__ import annotations

from ple_prep.cli import cli
from scripts.cli_reference import REFERENCE_PATH, REGENERATE, command_helps, render


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


def _commands() -> dict[str, object]:
    """Every command by path; a group that runs a default command (`profile`) stands for it too."""
    import click

    found = {}

    def walk(command, path):
        default = getattr(command, "default_command", None)
        found[path] = command.commands[default] if default else command
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")

    walk(cli, "ple-prep")
    return found


def test_help_every_model_option_resolves_hub_names():
    from ple_prep.cli import _ModelPath

    commands = _commands()
    with_model = {path for path, command in commands.items()
                  if any(param.name == "model" for param in command.params)}
    assert {"ple-prep convert", "ple-prep verify", "ple-prep profile"} <= with_model
    plain = [path for path in with_model
             if not any(param.name == "model" and isinstance(param.type, _ModelPath)
                        for param in commands[path].params)]
    assert not plain, f"--model without the shared model_option (no hub names): {plain}"


def test_help_data_commands_take_json_and_quiet():
    commands = _commands()
    options = {path: {opt for param in command.params for opt in getattr(param, "opts", [])}
               for path, command in commands.items()}
    for path in ("inspect", "verify", "profile", "bench", "convert", "demo"):
        assert "--json" in options[f"ple-prep {path}"], path
    for path in ("verify", "profile", "bench", "convert", "demo"):
        assert "--quiet" in options[f"ple-prep {path}"], path


def test_bare_command_prints_the_help_and_exits_zero():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ple_prep"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: ple-prep [OPTIONS] COMMAND [ARGS]...") and "Commands:" in done.stdout
    assert done.stderr == ""


def test_every_exit_status_is_documented_where_users_read():
    import re
    from pathlib import Path

    import ple_prep.cli as cli_module

    root = Path(__file__).resolve().parent.parent
    source = Path(cli_module.__file__).read_text()
    codes = {int(code) for code in re.findall(r"sys\.exit\((\d+)\)", source)} | {cli_module.EXIT_BUG}
    assert {1, 2, 70, 130} <= codes
    readme = (root / "README.md").read_text()
    sentence = re.search(r"Exit status: (.*?\.)\n\n", readme, flags=re.S)
    assert sentence, "the README's Scripting paragraph lists the exit status"
    documented = {int(code) for code in re.findall(r"(?<![\w.])(\d+) [a-z]", sentence.group(1))}
    assert documented == codes | {0}, f"README lists {sorted(documented)}, the CLI exits with {sorted(codes | {0})}"
    reference = (root / "docs" / "CLI.md").read_text()
    listed = re.search(r"Exit status, for every command: (.*?)\. With", reference, flags=re.S).group(1)
    assert {int(code) for code in re.findall(r"\*\*(\d+)\*\*", listed)} == codes | {0}


def test_help_quiet_mentions_json_only_where_there_is_json():
    wrong = []
    for path, command in _commands().items():
        names = {name for param in command.params for name in param.opts}
        quiet = next((param.help for param in command.params if "--quiet" in param.opts), "")
        if "--json" in quiet and "--json" not in names:
            wrong.append(path)
    assert not wrong, f"--quiet's help names --json output in commands without --json: {wrong}"
