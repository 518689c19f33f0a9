"""``python -m reproduce.workloads.traces.stats FILE``: print the facts of a trace
(``reproduce.workloads.traces.facts``)."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from reproduce.workloads.traces.facts import format_stats, trace_stats
from reproduce.workloads.traces.layouts import FORMATS
from reproduce.workloads.traces.reader import read_trace
from reproduce.workloads.traces.records import TraceError
from reproduce.workloads.traces.scaling import parse_window, window

__all__ = ["main"]


@click.command(name="stats")
@click.argument("trace", type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(FORMATS), default=None, help="Layout, if the header does not tell."
)
@click.option(
    "--reorder-window-s", type=float, default=0.0, show_default=True, help="Sort rows within this window."
)
@click.option("--keep-failed", is_flag=True, help="Keep BurstGPT's failed rows (0 response tokens).")
@click.option("--window", "window_text", default=None, help="START:END in seconds from the first request.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON object.")
def main(
    trace: str,
    fmt: str | None,
    reorder_window_s: float,
    keep_failed: bool,
    window_text: str | None,
    as_json: bool,
) -> None:
    """Print the facts of TRACE (any layout retrywatch reads; gzip too; a directory of trace
    files, such as a proxy's recording, as one). What was skipped on purpose (a recording's
    retries, a torn last line) is told on stderr."""
    notes: list[str] = []
    try:
        records = read_trace(
            trace, fmt, reorder_window_s=reorder_window_s, keep_failed=keep_failed, notes=notes
        )
        if window_text is not None:
            records = window(records, *parse_window(window_text))
        stats = trace_stats(records)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    for note in notes:
        click.echo(f"note: {note}", err=True)
    click.echo(json.dumps(asdict(stats)) if as_json else format_stats(stats))


if __name__ == "__main__":
    main()
