"""Validation of the alerts against a reproduce output: ``retrywatch reproduce validate DIR``.

Replays every run listed in ``DIR/summary.json`` through the detector (``detector.replay``) and
scores each alert against the runs' ground truth over time, which every run recorded in its
summary entry when it ended (``reproduce.judge.groundtruth``: its collapses, which are metastable).
One module a job (``reproduce.judge.validation``): ``runs`` parses the runs, ``scoring`` scores each
alert by its kind and each tier's pages, ``targets`` checks the targets the alerts are held to,
``markdown`` writes ``validation.md``, ``foreign`` scores another rule file's alerts in a real
Prometheus (``--rules``); this module assembles ``validation.json`` (:func:`build_report`), replays
a run (:func:`replay_firings`) and is the command, and keeps the public names importers use.

A run without a pulse (a replayed trace, a stepped load) is aligned on the burst that started its
first collapse (summary.json's ``burst``, ``reproduce.judge.groundtruth.burst_before``; the run's busiest
stretch when nothing collapsed), which stands where a pulse run's pulse stands (the overload's own
stretch, the lead after its end), and its windows are aligned to the run's start.

Writes ``DIR/validation.json`` (the shape in docs/architecture.md: per alert, per run with its
``collapses``, per block, and the ``targets`` of ``check_targets``) and ``DIR/validation.md``,
whose every table carries a legend. Times are seconds from the run's start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from detector.signals import Windows
from detector.thresholds import ALERTS, AlertKind, AlertRule
from foundation.rundir import (
    RULES_VALIDATION,
    RULES_VALIDATION_MD,
    SUMMARY,
    VALIDATION,
    VALIDATION_MD,
    VALIDATION_NOTHING_STATED,
    VALIDATION_NOTHING_STATED_MD,
    NotARunDir,
    RunDirError,
)
from reproduce.judge.validation.foreign import (
    DEFAULT_INTERVAL,
    DEFAULT_JOB,
    RuleFileError,
    RulesUnavailable,
    render_rules_markdown,
    validate_rules_dir,
)
from reproduce.judge.validation.markdown import render_markdown, summary_markdown
from reproduce.judge.validation.nothingstated import learned_summary, replay_nothing_stated
from reproduce.judge.validation.runs import Firing, RunInfo, RunResult, load_runs, truth_of
from reproduce.judge.validation.scoring import ground_truth_summary, score_alert, score_tiers, tier_pages
from reproduce.judge.validation.targets import BACKLOG, RETRY_LOOP, SILENCE, check_targets, loop_formed_at_s

__all__ = [
    "BACKLOG",
    "PAPER",
    "RETRY_LOOP",
    "SILENCE",
    "Firing",
    "RunInfo",
    "RunResult",
    "build_report",
    "check_targets",
    "load_runs",
    "loop_formed_at_s",
    "render_markdown",
    "replay_firings",
    "score_alert",
    "summary_markdown",
    "tier_pages",
    "truth_of",
    "validate",
    "validate_dir",
]

PAPER = "paper"  # the block made of every block: runs carry their own block's name


def build_report(
    results: Sequence[RunResult],
    alertnames: Sequence[str],
    kinds: Mapping[str, AlertKind] | None = None,
    rules: Sequence[AlertRule] = ALERTS,
) -> dict[str, Any]:
    """The whole ``validation.json`` document (``kinds``: each alert's kind, by default those of
    ``rules``; an alert it does not name is scored as a cause; ``rules`` also give each alert's
    tier and severity for the tiers' pages, :func:`score_tiers`)."""
    kinds = {r.name: r.kind for r in rules} if kinds is None else kinds
    tiers = {r.name: r.tier for r in rules}

    def scores(subset: Sequence[RunResult]) -> dict[str, Any]:
        return {
            name: {**score_alert(name, subset, kinds.get(name, "cause")), "tier": tiers.get(name)}
            for name in alertnames
        }

    blocks = list(dict.fromkeys(r.info.block for r in results))
    return {
        "alerts": scores(results),
        "tiers": score_tiers(results, rules, alertnames),
        "tiers_by_condition": {
            c: score_tiers(subset, rules, alertnames)
            for c in dict.fromkeys(r.info.condition for r in results)
            if (subset := [r for r in results if r.info.condition == c])
        },
        "ground_truth": ground_truth_summary(results),
        "by_block": {
            b: {
                "ground_truth": ground_truth_summary(subset),
                "alerts": scores(subset),
                "tiers": score_tiers(subset, rules, alertnames),
            }
            for b in blocks
            if (subset := [r for r in results if r.info.block == b])
        },
        "runs": [
            {
                "block": r.info.block,
                "condition": r.info.condition,
                "variant": r.info.variant,
                "model": r.info.model,
                "run": r.info.run,
                "recovered": r.info.recovered,
                "trace": r.info.trace,  # a replayed trace: "pulse" holds the burst it is aligned on
                "pulse": {"start_s": r.info.pulse_start_s, "end_s": r.info.pulse_end_s},
                "judged_end_s": r.info.judged_end_s,
                "duration_s": r.info.duration_s,
                "collapses": None if r.collapses is None else [c.to_dict() for c in r.collapses],
                "alerts": [
                    {"alertname": f.alertname, "fired_at_s": f.fired_at_s, "resolved_at_s": f.resolved_at_s}
                    for f in sorted(r.firings, key=lambda f: (f.fired_at_s, f.alertname))
                ],
            }
            for r in results
        ],
        "targets": check_targets(results),
    }


# --- replay and the command ---------------------------------------------------------------

Replayer = Callable[[RunInfo], list[Firing]]


def replay_firings(info: RunInfo, windows: Windows | None = None) -> list[Firing]:
    """Replay one run's series through the detector at the settings its plan recorded (its
    signals over ``windows`` instead where given, in the run's seconds) and return its episodes."""
    from detector.replay import replay_reproduce_run  # the detector's public replay API

    settings = info.detector if windows is None else replace(info.detector, windows=windows)
    episodes = replay_reproduce_run(info.series, info.capacity, info.deadline_s, settings)
    return [Firing.of(e) for e in episodes]


def all_alertnames() -> list[str]:
    return [a.name for a in ALERTS]


def _infos(out_dir: Path, block: str | None) -> list[RunInfo]:
    """The runs of ``out_dir`` to validate: every one, or one block's."""
    infos = load_runs(out_dir)
    if block is not None and block != PAPER:
        infos = [i for i in infos if i.block == block]
        if not infos:
            raise RunDirError(f"{out_dir / SUMMARY}: no run of block {block!r}")
    return infos


def validate_dir(
    out_dir: Path,
    *,
    replayer: Replayer = replay_firings,
    alertnames: Sequence[str] | None = None,
    kinds: Mapping[str, AlertKind] | None = None,
    block: str | None = None,
    nothing_stated: bool = False,
) -> dict[str, Any]:
    """Validate every run of ``out_dir`` (or of one block), write validation.json and .md; with
    ``nothing_stated``, replay each run with neither Ĉ nor the deadline stated
    (``reproduce.judge.validation.nothingstated``, ``replayer`` unused) and write the same report
    with ``"nothing_stated": true`` at its top and what each run ``learned``, beside the stated
    one (validation-nothing-stated.json and .md)."""
    infos = _infos(out_dir, block)
    unstated = [replay_nothing_stated(info) for info in infos] if nothing_stated else []
    results = []
    for i, info in enumerate(infos):
        truth = info.truth
        results.append(
            RunResult(
                info,
                unstated[i].firings if nothing_stated else replayer(info),
                None if truth is None else truth.collapses,
                None if truth is None else truth.windows,
            )
        )
    names = list(alertnames) if alertnames is not None else all_alertnames()
    report = build_report(results, names, kinds)
    json_name, md_name = VALIDATION, VALIDATION_MD
    if nothing_stated:
        report = {"nothing_stated": True, "learned": learned_summary(unstated), **report}
        for entry, run in zip(report["runs"], unstated, strict=True):
            entry["learned"] = run.learned()
        json_name, md_name = VALIDATION_NOTHING_STATED, VALIDATION_NOTHING_STATED_MD
    (out_dir / json_name).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / md_name).write_text(render_markdown(report), encoding="utf-8")
    return report


@click.command("validate")
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--block", default=None, help="Validate only the runs of this block (paper: every run).")
@click.option(
    "--rules",
    "rule_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Score this Prometheus rule file's alerts instead, evaluated by a real Prometheus over the "
    "runs (e.g. rules/peers/llm-d.yml): writes DIR/rules-validation.json and .md.",
)
@click.option(
    "--rules-job",
    default=DEFAULT_JOB,
    show_default=True,
    help="--rules: the job label every backfilled series carries (the rules may select on it).",
)
@click.option(
    "--rules-interval",
    default=DEFAULT_INTERVAL,
    show_default=True,
    help="--rules: the evaluation interval of a group that sets none.",
)
@click.option(
    "--nothing-stated",
    is_flag=True,
    help="Give the detector neither Ĉ nor the deadline: both learned from the series, as live "
    "(written to DIR/validation-nothing-stated.json and .md, beside the stated validation).",
)
def validate(
    out_dir: Path,
    block: str | None,
    rule_file: Path | None,
    rules_job: str,
    rules_interval: str,
    nothing_stated: bool,
) -> None:
    """Replay every run of a reproduce output DIR through the detector and score each alert
    against the runs' ground truth over time; print the scores (the tables docs/results.md
    quotes) and write DIR/validation.json and DIR/validation.md. With --rules, score another
    rule file's alerts over the same runs instead (docs/reproducing.md)."""
    try:
        if rule_file is not None:
            infos = _infos(out_dir, block)
            report = validate_rules_dir(
                out_dir, infos, rule_file, job=rules_job, default_interval=rules_interval
            )
            click.echo(render_rules_markdown(report))
            click.echo(f"wrote {out_dir / RULES_VALIDATION} and {out_dir / RULES_VALIDATION_MD}")
            return
        report = validate_dir(out_dir, block=block, nothing_stated=nothing_stated)
    except NotARunDir as exc:  # a usage mistake: exit 2, and nothing was written
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    except RuleFileError as exc:
        raise click.BadParameter(str(exc), param_hint="'--rules'") from None
    except (RunDirError, RulesUnavailable) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("\n".join(summary_markdown(report)))
    names = (
        (VALIDATION_NOTHING_STATED, VALIDATION_NOTHING_STATED_MD)
        if nothing_stated
        else (VALIDATION, VALIDATION_MD)
    )
    click.echo(f"wrote {out_dir / names[0]} and {out_dir / names[1]}")
