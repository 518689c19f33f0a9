"""The ``retrywatch`` console script: one click group, each subcommand owned by its package.

Subcommands are imported lazily so that ``retrywatch proxy`` never pays for Dash or
SQLAlchemy, and ``retrywatch --help`` stays fast.
"""

from __future__ import annotations

import importlib

import click

# name -> ("module:attribute", one-line help shown by ``retrywatch --help``)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "proxy": ("exporter.cli:proxy", "Run the execution-aware proxy in front of a vLLM engine."),
    "emulate": ("reproduce.emulate.cli:emulate", "Serve the engine model over HTTP in wall time."),
    "reproduce": ("reproduce.cli:reproduce", "Calibrate, run, report and validate pulse experiments."),
    "detect": ("detector.cli:detect", "Run the detector: signals, alerts, episodes, notifications."),
    "doctor": (
        "detector.doctorcli:doctor",
        "Say which alerts can evaluate against a vLLM (and a proxy, a Prometheus), and why not.",
    ),
    "dashboard": ("dashboard.cli:dashboard", "Run the operators' Dash dashboard."),
    "mixin": (
        "retrywatch.mixin:mixin",
        "Write the rules, alerts, Grafana dashboard and runbook for your Prometheus and Grafana.",
    ),
    # retrywatch/demo.py's command, with --fleet N (retrywatch/fleetdemo.py)
    "demo": ("retrywatch.fleetdemo:demo", "One command: engine, proxy, detector, dashboard and a pulse."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target[0].split(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target[0]} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from the table, so ``--help`` imports nothing heavy.
        rows = [(name, help_) for name, (_, help_) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="retrywatch")
def main() -> None:
    """retrywatch: see and break the retry loop that keeps a vLLM engine saturated."""
