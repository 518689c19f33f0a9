"""The operator's documents against the code they describe.

- every option of a ``retrywatch ...`` command line written out in README.md or docs/*.md is an
  option of that command;
- every alert and every ``retrywatch_*`` metric they name exists (the metrics as real processes,
  a proxy and a detector, expose them);
- the GPU page's run counts and engine caps are what its command makes of them;
- the runbook's checks for ``VLLMRetrywatchNoData`` find a proxy started without ``--capacity`` or
  ``--deadline`` (its gauges are then NaN, not absent), and nothing on one started with both.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from detector.thresholds import ALERTS, PROMETHEUS_ALERTS
from foundation.processes import ManagedProcess, free_port
from reproduce.conditions import PAPER, expand
from reproduce.harness.protocol import scaled_queue_cap
from reproduce.planner import daily
from retrywatch.cli import main as cli
from rules.learned import EXTRA_ALERTS
from tests.deploy.conftest import REPO

DOCS = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md")})
RUNBOOK = REPO / "docs" / "runbook.md"

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_CODE = re.compile(r"`([^`\n]+)`")
# `retrywatch`, `.venv/bin/retrywatch` ...: the words after it name the command, then its arguments.
_COMMAND = re.compile(r"(?:^|[\s(;&|])(?:[\w./-]*/)?retrywatch((?:\s+[a-z][a-z-]*)+)((?:\s+\S+)*)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _snippets(text: str) -> list[str]:
    """Every line of the fenced blocks (continuations joined) and every inline code span."""
    lines: list[str] = []
    for block in _FENCE.findall(text):
        lines.extend(re.sub(r"\\\n\s*", " ", block).splitlines())
    return lines + _CODE.findall(_FENCE.sub("", text))


def _options(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(param.opts)
        names.update(param.secondary_opts)
    return names


def unknown_options(snippet: str) -> list[str]:
    """The options a ``retrywatch ...`` command line in ``snippet`` passes that its command lacks."""
    problems: list[str] = []
    for match in _COMMAND.finditer(snippet):
        command: click.Command = cli
        path: list[str] = []
        words = match.group(1).split()
        for word in words:
            if not isinstance(command, click.Group):
                break
            sub = command.get_command(click.Context(command), word)
            if sub is None:
                break
            command, path = sub, [*path, word]
        if not path:
            continue
        rest = " ".join([*words[len(path) :], match.group(2)]).split(" #")[0]
        known = _options(command)
        problems += [f"retrywatch {' '.join(path)} {o}" for o in _OPTION.findall(rest) if o not in known]
    return problems


def test_the_option_check_finds_an_unknown_option() -> None:
    assert unknown_options("retrywatch proxy --upstream URL --no-such-option 1") == [
        "retrywatch proxy --no-such-option"
    ]
    assert unknown_options("`.venv/bin/retrywatch reproduce run --block paper --gpu`") == []
    assert unknown_options("retrywatch reproduce calibrate --gpu") == ["retrywatch reproduce calibrate --gpu"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_option_of_a_documented_command_line_exists(doc: Path) -> None:
    problems = [p for s in _snippets(doc.read_text(encoding="utf-8")) for p in unknown_options(s)]
    assert not problems, f"{doc.relative_to(REPO)} passes options its commands lack: {problems}"


def test_every_alert_the_documents_name_exists() -> None:
    # VLLMHeadroomLow: the daily what-if's own rule group (rules/headroom/), from its planner;
    # the rules' own alerts on the deadline they found (rules/learned.py).
    alerts = {rule.name for rule in ALERTS} | {rule.name for rule in PROMETHEUS_ALERTS} | {daily.ALERT}
    alerts |= {alert.name for alert in EXTRA_ALERTS}
    for doc in DOCS:
        named = set(re.findall(r"\bVLLM[A-Za-z]+", doc.read_text(encoding="utf-8")))
        assert named <= alerts, f"{doc.relative_to(REPO)} names unknown alerts: {sorted(named - alerts)}"


# --- real processes ------------------------------------------------------------------------------


def _server(tmp: Path, name: str, *args: str) -> tuple[ManagedProcess, str]:
    """``retrywatch ARGS --port=P`` started on a free port, and its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "retrywatch", *args, f"--port={port}"]
    proc = ManagedProcess(argv, log_path=tmp / f"{name}.log", bound_s=120, name=name).start()
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def expositions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``/metrics`` of a proxy without ``--capacity`` and ``--deadline`` ("bare"), of one with both
    and recording its traffic ("configured"), both in front of a port nobody listens on, and of a
    detector scraping the first ("detector")."""
    tmp = tmp_path_factory.mktemp("operator-docs")
    engine = f"--upstream=http://127.0.0.1:{free_port()}"
    servers: dict[str, tuple[ManagedProcess, str]] = {}
    try:
        servers["bare"] = _server(tmp, "bare", "proxy", engine)
        servers["configured"] = _server(
            tmp, "configured", "proxy", engine, "--capacity=2.78", "--deadline=120", f"--record={tmp / 'rec'}"
        )
        db = f"--db=sqlite:///{tmp / 'detector.db'}"
        servers["detector"] = _server(
            tmp, "detector", "detect", f"--exporter={servers['bare'][1]}/metrics", db
        )
        for proc, url in servers.values():
            proc.wait_ready(f"{url}/metrics", timeout_s=60, poll_s=0.1)
        yield {name: httpx.get(f"{url}/metrics", timeout=10).text for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.stop()


def test_every_metric_the_documents_name_is_exposed(expositions: dict[str, str]) -> None:
    exposed = {
        name
        for text in expositions.values()
        for family in text_string_to_metric_families(text)
        # a counter declared without a sample yet (labels made as they come) is exposed all the same
        for name in (
            family.name,
            *(s.name for s in family.samples),
            *([family.name + "_total"] if family.type == "counter" else []),
        )
    }
    # The daily what-if's series, served by `retrywatch reproduce plan-daily` once it has run
    # (tests/reproduce/planner/test_daily.py scrapes them from the real command).
    exposed |= {daily.HEADROOM_SERIES, daily.BEST_SERIES, daily.PEAK_SERIES, daily.MARGIN_SERIES,
                daily.LAST_RUN_SERIES}  # fmt: skip
    for doc in DOCS:
        # `$retrywatch_...` is an nginx variable, `instance:retrywatch_...` a recording rule,
        # `retrywatch_example.csv` a file.
        metric = r"(?<![\w$:])retrywatch_[a-z0-9_]*[a-z0-9](?![a-z0-9_]|\.\w)"
        named = set(re.findall(metric, doc.read_text(encoding="utf-8")))
        assert named <= exposed, (
            f"{doc.relative_to(REPO)} names metrics nothing exposes: {sorted(named - exposed)}"
        )


def _section_queries(text: str, heading: str) -> list[str]:
    """The PromQL expressions of a runbook section's ``promql`` blocks: each starts at a line's
    first column, goes on over indented lines, and ends at a blank or comment line."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    queries: list[list[str]] = []
    for block in re.findall(r"^```promql\n(.*?)^```", section, re.M | re.S):
        current: list[str] | None = None
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                current = None
            elif current is None or not line[0].isspace():
                current = [line]
                queries.append(current)
            else:
                current.append(line)
    return ["\n".join(q) for q in queries]


def _input_series(exposition: str) -> list[dict[str, str]]:
    """Every retrywatch_* sample of a real scrape as promtool input series of instance "r"."""
    out = []
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if not sample.name.startswith("retrywatch_"):
                continue
            labels = {**sample.labels, "job": "retrywatch", "instance": "r"}
            selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            value = "NaN" if sample.value != sample.value else repr(float(sample.value))
            out.append({"series": f"{sample.name}{{{selector}}}", "values": " ".join([value] * 13)})
    return out


@pytest.mark.promtool
@pytest.mark.parametrize("proxy", ["bare", "configured"])
def test_the_runbooks_nodata_checks_find_a_missing_capacity_and_deadline(
    expositions: dict[str, str], promtool: str, tmp_path: Path, proxy: str
) -> None:
    """A proxy started without --capacity or --deadline exports both gauges as NaN: a check that
    asks whether the series is absent finds nothing there, though NoData fires for it."""
    queries = _section_queries(RUNBOOK.read_text(encoding="utf-8"), "VLLMRetrywatchNoData")
    gauges = ("retrywatch_capacity_calls_per_second", "retrywatch_client_deadline_seconds")
    checks = {g: [q.replace("$i", "r") for q in queries if g in q] for g in gauges}
    assert all(checks.values()), f"the runbook's NoData section checks none of {gauges}: {queries}"
    found = [{"labels": "{}", "value": 1}] if proxy == "bare" else []
    test = {
        "evaluation_interval": "5s",
        "tests": [
            {
                "interval": "5s",
                "input_series": _input_series(expositions[proxy]),
                "promql_expr_test": [
                    # A newline ends a query's trailing comment before the closing brackets.
                    {"expr": f"clamp_max(count(\n{q}\n), 1)", "eval_time": "30s", "exp_samples": found}
                    for qs in checks.values()
                    for q in qs
                ],
            }
        ],
    }
    path = tmp_path / "nodata.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False), encoding="utf-8")
    proc = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, (
        f"the runbook's NoData checks on the {proxy} proxy:\n{proc.stdout}{proc.stderr}"
    )


def _gpu_run_command(text: str) -> click.Context:
    """The first `retrywatch reproduce run --backend vllm --gpu` of the GPU page, parsed by the real
    command line (nothing run)."""
    for block in _FENCE.findall(text):
        line = re.sub(r"\\\n\s*", " ", block).split("reproduce run ", 1)
        if len(line) == 2 and "--gpu" in line[1]:
            args = shlex.split(line[1].splitlines()[0])
            reproduce = cli.get_command(click.Context(cli), "reproduce")
            assert isinstance(reproduce, click.Group)
            run = reproduce.get_command(click.Context(reproduce), "run")
            assert run is not None
            return run.make_context("run", args, resilient_parsing=True)
    raise AssertionError("docs/gpu-reproduction.md has no `reproduce run --backend vllm --gpu` command")


def test_the_gpu_pages_run_counts_and_engine_caps_are_the_harnesss() -> None:
    """The GPU page's diagnostic command runs as many runs as the page says (the study's, for the
    architecture the model is), and the engine caps it quotes for
    the capacity it passes are those the harness starts vLLM with."""
    text = (REPO / "docs" / "gpu-reproduction.md").read_text(encoding="utf-8")
    params = _gpu_run_command(text).params
    text = " ".join(text.split())  # the figures below may sit across a line break
    model, runs = params["model"], params["runs"]
    assert f"({len(expand(params['block_slug'], models=model, runs=runs))} runs" in text
    assert f"its {len(expand(PAPER, models=model))} runs of the study's {len(expand(PAPER))}" in text
    options = dict(o.split("=", 1) for o in params["backend_options"])
    capacity = float(options["capacity"])
    caps = [scaled_queue_cap(q, capacity, 120.0) for q in (338, 100)]
    assert f"{caps[0]} and {caps[1]} at the {capacity:g} passed above" in text
