"""Every command and snippet of the README runs as written (on the example checkpoint, CPU only).

The shell blocks run in order in one shell in an empty folder, so the names the walk-through sets
(`MODEL`, `TABLE`) carry from block to block; the Python blocks run after them in the same folder.
What cannot run inside the test suite is checked instead: the install steps must be the ones
listed here (the environment running the tests is that install), the test command must be the one
`.ci/run` runs, and the vLLM test environment's script must exist.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from support.environment import child_environment

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", README, flags=re.M | re.S)
VENV = "python3 -m venv .venv && . .venv/bin/activate"
CPU_TORCH_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
INSTALLS = {"pip install .", "pip install '.[torch,plot]'", "pip install torch==2.13.0 -e '.[test]'",
            f"pip install torch {CPU_TORCH_INDEX}   # only on a machine without a GPU"}
TESTS = "ruff check ple_prep tests bench && python -m pytest -q"


def _runnable(command: str) -> str | None:
    """The part of a README command the test can run: install steps are checked and dropped; the
    test command itself is checked against .ci/run and not run (it is this suite)."""
    steps = [step.strip() for step in command.split("&&")]
    if " && ".join(steps[:2]) == VENV:
        steps = steps[2:]
    if steps and steps[0].startswith("pip install"):
        assert steps[0] in INSTALLS, f"an install the test does not know: {steps[0]}"
        steps = steps[1:]
    if " && ".join(steps) == TESTS:
        ci = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
        assert re.sub(r"\s+", " ", f"{VENV} && pip install torch==2.13.0 -e '.[test]' && {TESTS}") in \
            re.sub(r"\s+", " ", ci), ".ci/run must run the README's test command"
        return None
    return " && ".join(steps) or None


def _shell_script() -> str:
    lines = []
    for language, body in BLOCKS:
        if language != "bash":
            continue
        if "scripts/vllm-test-env.sh" in body:
            # Downloads vLLM (~2.2 GB): documented as outside CI; its script must exist.
            assert (ROOT / "scripts" / "vllm-test-env.sh").is_file()
            continue
        for command in re.sub(r"\\\n", " ", body).splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                lines.append(_runnable(command) or "true")
    return "\n".join(lines)


def _environment(folder: Path) -> dict[str, str]:
    env = child_environment()
    if shutil.which("ple-prep") is None or not shutil.which("ple-prep").startswith(str(Path(sys.executable).parent)):
        # Not installed as a script here (the package is on PYTHONPATH): the same entry point.
        shim = folder / ".bin" / "ple-prep"
        shim.parent.mkdir()
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ple_prep \"$@\"\n")
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}{os.pathsep}{env['PATH']}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def test_readme_blocks_are_all_seen():
    languages = [language for language, _ in BLOCKS]
    assert languages.count("bash") >= 8 and languages.count("python") >= 1
    assert set(languages) <= {"bash", "python", "text"}


def test_readme_commands_and_snippets_run_as_written(tmp_path):
    script = _shell_script()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # The plot extra is not installed in this environment (CI installs it with the tests).
        script = "\n".join(line for line in script.splitlines() if "--plot" not in line)
    env = _environment(tmp_path)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert (tmp_path / "ple.bin").is_file() and (tmp_path / "bench.json").is_file()
    for language, body in BLOCKS:
        if language == "python":
            done = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{body}\n--- stderr\n{done.stderr}"
            assert "torch.Size([3, 2560]) torch.bfloat16" in done.stdout


def test_readme_and_the_vllm_script_say_where_the_cpu_torch_is():
    # On the package index torch's Linux wheels are CUDA builds: the CPU build is on PyTorch's index.
    assert f"pip install torch==2.13.0 {CPU_TORCH_INDEX}" in README
    script = (ROOT / "scripts" / "vllm-test-env.sh").read_text()
    torch_install = next(line for line in script.splitlines() if re.match(r"pip torch==2\.13\.0\b", line))
    assert "torch_index" in torch_install
    assert f'{CPU_TORCH_INDEX.split()[0]} "${{TORCH_INDEX_URL:-{CPU_TORCH_INDEX.split()[1]}}}"' in script
