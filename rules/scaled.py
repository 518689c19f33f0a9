"""The rules at a time scale: ``rules.generate``'s rule documents with every duration divided by K.

A scaled run (``retrywatch reproduce --time-scale K``) divides every duration by K, and the Python
detector divides its ``for``s and its signal windows by the same K (``AlertRule.scaled``,
``Windows.scaled``). A real Prometheus beside such a run needs the same rules with every duration
divided by K: the group's evaluation interval, each alert's ``for`` and ``keep_firing_for``, and
every range, subquery and offset in each expression. Thresholds are ratios (or zero) and stay.
The vLLM tier's deadline and its e2e bucket come from the deadline series (``rules.learned``), as
at K = 1: a run at K states its scaled deadline, and the bucket at or below it is chosen then.
:func:`lookback_delta` is the Prometheus flag that scales its gauges' lookback the same way.

``python -m rules.scaled K FILE`` writes them (one file, YAML that Prometheus and promtool load).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from detector.runbook import DEFAULT_PATTERN
from detector.signals import WINDOWS
from foundation.options import FiniteFloatRange
from rules.backfill import parse_duration
from rules.generate import duration, rule_documents

_DURATION = r"(?:\d+(?:ms|s|m|h|d|w|y))+"
# a range or a subquery ([5m], [5m:], [5m:30s]) and an offset, in PromQL
_RANGE = re.compile(rf"\[({_DURATION})(?::({_DURATION})?)?\]")
_OFFSET = re.compile(rf"(\boffset\s+-?)({_DURATION})")


def scale_duration(text: str, time_scale: float) -> str:
    """A Prometheus duration divided by K (``1m`` at K = 10: ``6s``)."""
    return duration(parse_duration(text) / time_scale)


def scale_expr(expr: str, time_scale: float) -> str:
    """A PromQL expression with every range, subquery and offset duration divided by K."""

    def ranged(m: re.Match[str]) -> str:
        step = "" if m.group(2) is None else scale_duration(m.group(2), time_scale)
        colon = ":" if ":" in m.group(0) else ""
        return f"[{scale_duration(m.group(1), time_scale)}{colon}{step}]"

    out = _RANGE.sub(ranged, expr)
    return _OFFSET.sub(lambda m: m.group(1) + scale_duration(m.group(2), time_scale), out)


def scaled_documents(time_scale: float, runbook_pattern: str = DEFAULT_PATTERN) -> dict[str, Any]:
    """``rules.generate.rule_documents`` with every duration divided by ``time_scale`` (K = 1:
    the rules as generated)."""
    k = time_scale
    doc = rule_documents(runbook_pattern)
    for group in doc["groups"]:
        if "interval" in group:
            group["interval"] = scale_duration(group["interval"], k)
        for rule in group["rules"]:
            rule["expr"] = scale_expr(rule["expr"], k)
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    rule[key] = scale_duration(rule[key], k)
    return doc


def lookback_delta(time_scale: float) -> str:
    """The value of Prometheus' ``--query.lookback-delta`` at K: the signals' gauge lookback / K."""
    return duration(WINDOWS.scaled(time_scale).gauge_lookback_s)


def write_scaled(path: Path, time_scale: float, runbook_pattern: str = DEFAULT_PATTERN) -> Path:
    """Write the scaled rules to ``path`` (JSON is YAML: Prometheus and promtool read it)."""
    doc = scaled_documents(time_scale, runbook_pattern)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


@click.command()
@click.argument("time_scale", type=FiniteFloatRange(min=0.0, min_open=True))
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def main(time_scale: float, path: Path) -> None:
    """Write the rules at TIME_SCALE (every duration divided by it) to PATH."""
    write_scaled(path, time_scale)
    click.echo(
        f"wrote {path} (durations divided by {time_scale:g}; run Prometheus with "
        f"--query.lookback-delta={lookback_delta(time_scale)})"
    )


if __name__ == "__main__":
    main()
