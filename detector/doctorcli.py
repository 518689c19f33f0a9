"""``retrywatch doctor``: which alerts can evaluate against a vLLM (a proxy, a Prometheus), in a
few plain lines to paste into an issue; exit 1 when a page cannot fire (``detector.doctor``).

``--capacity`` and ``--deadline`` are ``retrywatch detect``'s own options (the same declaration).
"""

from __future__ import annotations

import re

import click

from detector.cli import detect
from detector.signals import PROMETHEUS_JOBS
from foundation.options import FiniteFloatRange
from foundation.redact import redact_url

_DETECT_OPTIONS = {p.name: p for p in detect.params}
# label matchers, as inside a PromQL selector's braces: name="value", name=~"regex", ...
_MATCHERS = re.compile(
    r'\s*\w+\s*(=~|!=|!~|=)\s*"(?:[^"\\]|\\.)*"\s*(,\s*\w+\s*(=~|!=|!~|=)\s*"(?:[^"\\]|\\.)*"\s*)*'
)


def _url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"an http(s):// URL, not {redact_url(value)!r}")
    return value


def _selector(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value and not _MATCHERS.fullmatch(value):
        raise click.BadParameter(
            f'label matchers as inside a PromQL selector (namespace="prod"), not {value!r}'
        )
    return value.strip()


@click.command("doctor")
@click.option("--vllm", callback=_url, help="vLLM's address (http://HOST:PORT) or its /metrics URL.")
@click.option("--proxy", callback=_url, help="A retrywatch proxy's address or its /metrics URL.")
@click.option("--prometheus", callback=_url, help="The Prometheus that runs retrywatch's rules (base URL).")
@click.option(
    "--selector",
    default="",
    callback=_selector,
    help='Label matchers narrowing Prometheus\' series to one engine or fleet (instance="10.0.0.7:8000").',
)
@click.option(
    "--vllm-job",
    default=PROMETHEUS_JOBS["vllm"],
    show_default=True,
    help="Prometheus' scrape job of vLLM, as the rules were rendered for (retrywatch mixin --vllm-job).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds each answer may take, whole.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("text", "json")),
    default="text",
    show_default=True,
    help="text for people, json for machines.",
)
def doctor(
    vllm: str | None,
    proxy: str | None,
    prometheus: str | None,
    selector: str,
    vllm_job: str,
    timeout_s: float,
    fmt: str,
    capacity: float | None,
    deadline: float | None,
) -> None:
    """Say which vLLM release this looks like, which series the alerts read are present, and which
    alerts can evaluate; exit 1 when a page cannot fire."""
    from detector.doctor import render_text
    from detector.doctorread import run

    if not (vllm or proxy or prometheus):
        raise click.UsageError("give --vllm URL (and optionally --proxy URL, --prometheus URL)")
    report = run(
        vllm=vllm,
        proxy=proxy,
        prometheus=prometheus,
        selector=selector,
        vllm_job=vllm_job,
        capacity=capacity,
        deadline=deadline,
        timeout_s=timeout_s,
    )
    click.echo(report.to_json() if fmt == "json" else render_text(report), nl=fmt == "json")
    raise SystemExit(report.exit_code)


doctor.params.extend((_DETECT_OPTIONS["capacity"], _DETECT_OPTIONS["deadline"]))
