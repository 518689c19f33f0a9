"""README.md's two commands, as a newcomer runs them: the quick start (set up and run the demo) is
safe to run twice, and the test command is ``bash .ci/run``, which installs what the tests need
and runs them itself. The commands are read from README.md, so these tests follow it."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

from tests.systemtools import require

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def section_commands(heading: str) -> list[str]:
    """The command lines of the fenced blocks under README.md's ``## heading``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for block in _FENCE.findall(body) for line in block.splitlines() if line.strip()]


def test_the_quick_starts_venv_step_runs_twice(tmp_path: Path) -> None:
    """``uv venv .venv`` stopped a second run of the one-liner: "A virtual environment already
    exists" (exit 2 in a script, a prompt in a terminal)."""
    one_liner = section_commands("Quick start")[0]
    steps = [step.strip() for step in one_liner.split("&&")]
    (venv,) = [shlex.split(step) for step in steps if step.startswith("uv venv")]
    uv = require("uv")
    for attempt in (1, 2):
        done = subprocess.run(
            [uv, *venv[1:]],
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"run {attempt} of {' '.join(venv)}: {done.stderr}"
    assert (tmp_path / ".venv" / "bin" / "python").exists()


def test_the_test_command_is_ci_run_which_installs_and_runs_the_tests_itself() -> None:
    assert section_commands("Run the tests")[0] == "bash .ci/run"
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    code = [line.split("#", 1)[0] for line in script.splitlines()]
    assert any(line.strip() == ".venv/bin/python -m pytest" for line in code)
    assert not any(".ci/run" in line for line in code)  # it never runs itself


def test_the_fast_subset_deselects_only_declared_markers() -> None:
    """The fast subset's ``-m`` expression names markers pytest knows (an unknown one would
    deselect nothing and say nothing)."""
    fast = section_commands("Run the tests")[1]
    words = shlex.split(fast)
    assert words[:3] == [".venv/bin/python", "-m", "pytest"]
    expression = words[words.index("-m", 3) + 1]
    named = set(re.findall(r"not (\w+)", expression))
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    declared = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert named == declared
