"""`promtool check rules` and `promtool test rules` on the generated rules and their tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rules import generate, unittests
from rules.backfill import parse_duration

pytestmark = pytest.mark.promtool

TEST_FILES = sorted(unittests.TESTS_DIR.glob("*.test.yml"))


def _promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def test_check_rules(promtool: str) -> None:
    proc = _promtool(promtool, "check", "rules", str(generate.RULES_PATH))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_rules = sum(
        1 for line in generate.render().splitlines() if line.lstrip().startswith(("- record:", "- alert:"))
    )
    assert f"SUCCESS: {n_rules} rules found" in proc.stdout


def test_a_test_file_per_alert() -> None:
    assert [p.name for p in TEST_FILES] == sorted(
        f"{s.alertname.lower()}.test.yml" for s in unittests.SCENARIOS
    )


def test_promtool_unit_tests_pass(promtool: str) -> None:
    proc = _promtool(promtool, "test", "rules", *(p.name for p in TEST_FILES), cwd=unittests.TESTS_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TEST_FILES)


def test_the_unit_tests_catch_a_for_window_one_evaluation_longer(promtool: str, tmp_path: Path) -> None:
    """The tests pin the `for` edges: with every `for` one evaluation longer, a test fails."""
    lines = []
    for line in generate.render().splitlines():
        key, _, value = line.partition("for: ")
        if value and key.strip() == "":
            line = f"{key}for: {generate.duration(parse_duration(value) + generate.EVALUATION_INTERVAL_S)}"
        lines.append(line)
    (tmp_path / "retrywatch.rules.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "tests").mkdir()
    target = unittests.TESTS_DIR / "vllmbacklogbeyonddeadline.test.yml"
    shutil.copy(target, tmp_path / "tests" / target.name)
    proc = _promtool(promtool, "test", "rules", target.name, cwd=tmp_path / "tests")
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout + proc.stderr
    assert "VLLMBacklogBeyondDeadline" in proc.stdout + proc.stderr
