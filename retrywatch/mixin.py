"""``retrywatch mixin --out DIR``: the monitoring bundle for an existing Prometheus and Grafana.

Laid out as the monitoring mixins lay theirs out (kubernetes-mixin, node-mixin), every file
rendered from the same source as the files committed in the repository:

- ``prometheus_rules.yaml``: the recording rules and the alerts (``rules.generate``), for the
  vLLM scrape job, deadline and Ĉ stated (``rules.stated``). Unlike the
  mixins' split into ``prometheus_rules.yaml`` and ``prometheus_alerts.yaml``, each alert stays
  in the group of the recording rules it reads: Prometheus evaluates a group's rules in order at
  one timestamp, so an alert reads the signals of its own evaluation, as the detector does and as
  the promtool tests check. A separate alerts group would read them one evaluation late.
- ``prometheusrule.yaml``: the same groups as a prometheus-operator PrometheusRule
  (``rules.prometheusrule``);
- ``dashboards_out/retrywatch.json``: the Grafana dashboard (``dashboard.grafana``), its vLLM rows
  opening on the stated vLLM scrape job, deadline and Ĉ;
- ``runbook.md``: the runbook every alert's ``runbook_url`` points into (``detector.runbook``).

The options are those the generated files take: each alert's runbook link, and the vLLM job,
deadline and Ĉ of both the rules and the dashboard.
"""

from __future__ import annotations

from pathlib import Path

import click

from dashboard import grafana
from detector.runbook import DEFAULT_PATTERN, runbook_markdown, runbook_option
from detector.signals import DEFAULT_DEADLINE_S
from rules import prometheusrule, stated

RULES_FILE = "prometheus_rules.yaml"
PROMETHEUS_RULE_FILE = "prometheusrule.yaml"
DASHBOARD_FILE = "dashboards_out/retrywatch.json"
RUNBOOK_FILE = "runbook.md"
BUNDLE_FILES = (RULES_FILE, PROMETHEUS_RULE_FILE, DASHBOARD_FILE, RUNBOOK_FILE)

_HEADER = (
    "# Part of the retrywatch mixin bundle, written by `retrywatch mixin`: regenerate it, do not edit.\n"
)


class BundleError(ValueError):
    """The bundle cannot be written where asked; the message says why and what to do."""


def bundle(
    options: grafana.Options | None = None, runbook_pattern: str = DEFAULT_PATTERN, *, proxy_tier: bool = True
) -> dict[str, str]:
    """{file name under the bundle's directory: text} of every file of the bundle; its rules
    without the proxy tier's group unless ``proxy_tier``."""
    options = options or grafana.Options()
    rules_text = stated.render(
        runbook_pattern,
        vllm_job=options.vllm_job,
        deadline_s=options.deadline_s,
        capacity=options.capacity,
        proxy_tier=proxy_tier,
    )
    return {
        RULES_FILE: _HEADER + rules_text,
        PROMETHEUS_RULE_FILE: prometheusrule.render_text(rules_text, header=_HEADER),
        DASHBOARD_FILE: grafana.render(options),
        RUNBOOK_FILE: runbook_markdown(),
    }


def foreign_entries(out_dir: Path) -> list[Path]:
    """What ``out_dir`` holds that is no file of a bundle (writing there would mix the two): a
    bundle file's name that is a link, a FIFO or a directory is not one either (writing would go
    through the link, or wait for a reader forever)."""
    if not out_dir.exists():
        return []
    if not out_dir.is_dir():
        return [out_dir]
    files = {out_dir / name for name in BUNDLE_FILES}
    folder = (out_dir / DASHBOARD_FILE).parent

    def ours(path: Path) -> bool:
        if path.is_symlink():
            return False
        return path.is_file() if path in files else path == folder and path.is_dir()

    return sorted(p for p in out_dir.rglob("*") if not ours(p))


def write_bundle(out_dir: Path, files: dict[str, str]) -> list[Path]:
    """Write the bundle's ``files`` (:func:`bundle`) into ``out_dir`` (created if missing; a
    previous bundle there is replaced); the paths written. A directory holding anything else is
    refused, untouched."""
    foreign = foreign_entries(out_dir)
    if foreign:
        names = ", ".join(str(p) for p in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise BundleError(
            f"{out_dir} holds files that are not the bundle's ({names}): choose an empty directory"
        )
    written = []
    try:
        for name, text in files.items():
            path = out_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written.append(path)
    except OSError as exc:  # a read-only file system, no permission, a disk full, a file on the way
        blocker = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
        where = "" if exc.filename in (None, str(out_dir)) else f"{exc.filename}: "
        why = f"{blocker} is a file, not a directory" if blocker else where + (exc.strerror or str(exc))
        raise BundleError(f"cannot write the bundle into {out_dir}: {why}") from exc
    return written


def _job(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """The job as both the rules (``rules.stated``) and the dashboard (``dashboard.grafana``) can
    write it, or the reason why not, naming the option."""
    try:
        grafana.Options(vllm_job=stated.check_job(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return value


def _positive(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise click.BadParameter(f"must be > 0, got {value!r}", ctx=ctx, param=param)
    return value


@click.command()
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Directory to write into."
)
@click.option(
    "--vllm-job",
    default=grafana.DEFAULT_VLLM_JOB,
    show_default=True,
    callback=_job,
    help="The scrape job of vLLM's own targets in your Prometheus.",
)
@click.option(
    "--deadline",
    "deadline_s",
    type=float,
    default=DEFAULT_DEADLINE_S,
    show_default=True,
    callback=_positive,
    help="The clients' deadline on a request, in seconds.",
)
@click.option(
    "--capacity",
    type=float,
    default=None,
    callback=_positive,
    help="Ĉ, the engine's capacity in calls per second (the dashboard draws it where given).",
)
@click.option(
    "--tier",
    type=click.Choice(["all", "vllm"]),
    default="all",
    show_default=True,
    help="The rules of every tier, or of the vLLM tier alone (before the proxy: no alert that says "
    "there is no proxy).",
)
@runbook_option(default=DEFAULT_PATTERN, help_default="the detector's /runbook at its default address")
def mixin(
    out_dir: Path, vllm_job: str, deadline_s: float, capacity: float | None, tier: str, runbook_pattern: str
) -> None:
    """Write the Prometheus rules and alerts, the PrometheusRule, the Grafana dashboard and the
    runbook into one directory, for a Prometheus and a Grafana you already run."""
    try:
        options = grafana.Options(vllm_job=vllm_job, deadline_s=deadline_s, capacity=capacity)
        files = bundle(options, runbook_pattern, proxy_tier=tier == "all")
    except (ValueError, stated.StatedError) as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        written = write_bundle(out_dir, files)
    except BundleError as exc:
        raise click.ClickException(str(exc)) from None
    for path in written:
        click.echo(f"wrote {path}")
