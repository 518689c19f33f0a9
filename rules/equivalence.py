"""Do the Python detector and the rules in a real Prometheus agree on a reproduce output?

``python -m rules.equivalence DIR`` replays every run of ``DIR/summary.json`` through
``detector.replay.replay_run`` and evaluates ``rules/retrywatch.rules.yml`` over the same series
in a real Prometheus (``rules.backfill.evaluate_rules``), then pairs each alert's episodes in
order: they agree when both have the same episodes, each fired and resolved within one
evaluation interval of the other. Prints one line per disagreeing run and a total; exits 1 on
any disagreement. Needs ``promtool`` and ``prometheus`` (Debian's ``prometheus`` package).

The replay assumes no deadline where no series states one, as ``retrywatch detect`` and the rules
do; the alerts only the rules evaluate (``rules.learned.EXTRA_ALERTS``, on how they found the
deadline) are left out of the comparison.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import click
import yaml

from foundation.rundir import RunDirError, read_summary, run_slug, series_path
from foundation.timeseries import Snapshot, read_series

Key = tuple[str, float, float | None]  # (alertname, fired_at_s, resolved_at_s)


def disagreements(python: Sequence[Key], prometheus: Sequence[Key], *, tolerance_s: float) -> list[str]:
    """Differences beyond ``tolerance_s`` between two runs' episodes, pairing each alert's in order."""
    problems: list[str] = []
    for name in sorted({k[0] for k in [*python, *prometheus]}):
        py = [k for k in python if k[0] == name]
        pr = [k for k in prometheus if k[0] == name]
        if len(py) != len(pr):
            problems.append(f"{name}: python {py} vs prometheus {pr}")
            continue
        for a, b in zip(py, pr, strict=True):
            fired_ok = abs(a[1] - b[1]) <= tolerance_s
            resolved_ok = (a[2] is None and b[2] is None) or (
                a[2] is not None and b[2] is not None and abs(a[2] - b[2]) <= tolerance_s
            )
            if not (fired_ok and resolved_ok):
                problems.append(f"{name}: python {a} vs prometheus {b}")
    return problems


def python_verdict(series_path: Path) -> list[Key]:
    """The detector's episodes on a run, with no deadline assumed (as the rules)."""
    from detector.replay import replay_run

    episodes = replay_run(series_path, assumed_deadline=None)
    return sorted((e.alertname, e.started_at, e.resolved_at) for e in episodes)


def rules_only() -> frozenset[str]:
    """The alerts only the rules evaluate: no Python verdict to compare them with."""
    from rules.learned import EXTRA_ALERTS

    return frozenset(a.name for a in EXTRA_ALERTS)


def prometheus_verdicts(runs: Mapping[str, Sequence[Snapshot]], rules_path: Path) -> dict[str, list[Key]]:
    from rules.backfill import evaluate_rules
    from rules.generate import group_job

    doc = yaml.safe_load(rules_path.read_text(encoding="utf-8"))
    skip = rules_only()
    return {
        instance: sorted(
            (e.alertname, e.fired_at_s, e.resolved_at_s) for e in episodes if e.alertname not in skip
        )
        for instance, episodes in evaluate_rules(runs, doc, job=group_job).items()
    }


@click.command()
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--block", default=None, help="Only the runs of this block.")
def main(out_dir: Path, block: str | None) -> None:
    """Compare the detector's and Prometheus' verdicts on every run of a reproduce output DIR."""
    from rules.generate import EVALUATION_INTERVAL_S, RULES_PATH

    try:
        summary = read_summary(out_dir)
        paths = {
            run_slug(run): series_path(out_dir, run)
            for run in summary["runs"]
            if block is None or run["block"] == block
        }
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from exc
    t0 = time.monotonic()
    python = {slug: python_verdict(path) for slug, path in paths.items()}
    t1 = time.monotonic()
    prometheus = prometheus_verdicts({slug: list(read_series(p)) for slug, p in paths.items()}, RULES_PATH)
    t2 = time.monotonic()
    bad = 0
    episodes = 0
    for slug in paths:
        episodes += len(python[slug])
        problems = disagreements(python[slug], prometheus.get(slug, []), tolerance_s=EVALUATION_INTERVAL_S)
        if problems:
            bad += 1
            click.echo(f"{slug}: " + "; ".join(problems))
    click.echo(
        f"{len(paths) - bad}/{len(paths)} runs agree within {EVALUATION_INTERVAL_S:g} s "
        f"({episodes} detector episodes); detector {t1 - t0:.1f} s, Prometheus {t2 - t1:.1f} s"
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
