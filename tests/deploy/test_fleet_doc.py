"""docs/fleet.md names real files, and every shipped deployment file is described there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from rules.generate import RULES_PATH
from tests.deploy.conftest import DEPLOY, REPO

DOC = (REPO / "docs" / "fleet.md").read_text(encoding="utf-8")


def test_every_path_the_page_names_exists() -> None:
    named = set(re.findall(r"\b((?:deploy|tests/deploy|rules|docs)/[\w./-]*\w)", DOC))
    assert named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/fleet.md names paths that do not exist: {missing}"


def test_every_shipped_configuration_is_described() -> None:
    shipped = {
        p.parent.relative_to(REPO).as_posix()
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    undescribed = sorted(d for d in shipped if d not in DOC and d != "deploy")
    assert not undescribed, f"docs/fleet.md does not mention {undescribed}"


_ESTIMATE_TEST = """\
rule_files: [{rules}]
evaluation_interval: 5s
tests:
  - interval: 5s
    input_series:
      - series: 'up{{job="retrywatch",instance="r"}}'
        values: '1x1000'
      - series: 'vllm:num_requests_waiting{{job="retrywatch",instance="r",engine="0",model_name="m"}}'
        values: '5x72 0x1000'
      - series: 'retrywatch_executions_finished_total{{job="retrywatch",instance="r",fate="completed"}}'
        values: '0+2x1000'
      - series: 'retrywatch_executions_created_total{{job="retrywatch",instance="r"}}'
        values: '0+2x1000'
      - series: 'retrywatch_client_deadline_seconds{{job="retrywatch",instance="r"}}'
        values: '120x1000'
    promql_expr_test:
      - expr: count(instance:retrywatch_capacity:calls_per_second)
        eval_time: 50m
        exp_samples: [{{labels: '{{}}', value: 1}}]
      - expr: count(instance:retrywatch_capacity:calls_per_second)
        eval_time: 70m
        exp_samples: []
      - expr: instance:retrywatch_data_missing:bool
        eval_time: 70m
        exp_samples: [{{labels: 'instance:retrywatch_data_missing:bool{{instance="r"}}', value: 1}}]
"""


def _words(text: str) -> str:
    """The text's words, lower-cased, comment marks and line breaks left out."""
    return " ".join(" ".join(re.sub(r"^\s*#", "", line) for line in text.splitlines()).split()).lower()


def test_the_capacity_estimate_and_its_hour_are_described_as_the_rules_keep_them(
    promtool: str, tmp_path: Path
) -> None:
    """Without --capacity, Ĉ is the average of the saturated 5-minute stretches of the last hour:
    an hour after a replica's last one, the estimate is gone and NoData fires again (not only
    "until a replica has had one"). The fleet page and the engine manifest must say so."""
    test = tmp_path / "estimate.test.yml"
    test.write_text(_ESTIMATE_TEST.format(rules=RULES_PATH), encoding="utf-8")
    proc = subprocess.run(
        [promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    engine = (DEPLOY / "kubernetes" / "base" / "engine.yaml").read_text(encoding="utf-8")
    for name, text in (("docs/fleet.md", DOC), ("engine.yaml", engine)):
        words = _words(text)
        start = words.index("without it ĉ is estimated")
        claim = words[start : words.index("nodata", start)]
        assert "last hour" in claim and "an hour old" in claim, f"{name}: {claim}"
