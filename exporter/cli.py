"""``retrywatch proxy``: run the execution-aware proxy (served by ``foundation.server``).

The options are the knobs of ``exporter.settings.ProxySettings`` (``foundation.knobs``). Every option
can also be set by an environment variable ``RETRYWATCH_<OPTION>`` (upper case, dashes as
underscores), e.g. ``RETRYWATCH_UPSTREAM``, ``RETRYWATCH_CANCEL_AFTER``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import click

from exporter.policy import PolicyConfigError
from exporter.settings import ProxySettings, SettingsError
from foundation.bounds import base_url
from foundation.knobs import Knob, env_var, knobs
from foundation.logs import announce, check_port, log_options, setup_logging
from foundation.redact import redact_url

FC = TypeVar("FC", bound=Callable[..., Any])


def _click_type(k: Knob) -> click.ParamType[Any] | None:
    o = k.option
    if isinstance(k.kind, type) and issubclass(k.kind, enum.Enum):
        return click.Choice([str(e.value) for e in k.kind])
    if k.kind is int:
        return click.IntRange(
            None if o.minimum is None else int(o.minimum), None if o.maximum is None else int(o.maximum)
        )
    if k.kind is float:
        return click.FloatRange(o.minimum, o.maximum, min_open=o.exclusive)
    return None  # str, and the items of a tuple


def knob_options(settings: type) -> Callable[[FC], FC]:
    """The click options of every knob of ``settings`` (see ``foundation.knobs``), each also set by
    its environment variable; the parameters are named after the fields."""

    def decorate(command: FC) -> FC:
        # Required options first in --help, then the rest in declaration order.
        for k in reversed(sorted(knobs(settings), key=lambda k: not k.required)):
            flag = f"--{k.option.flag}"
            common: dict[str, Any] = {
                "envvar": env_var(k.option.flag),
                "show_envvar": True,
                "show_default": True,
                "help": k.option.help,
            }
            if k.kind is bool and k.default is True:
                option = click.option(f"{flag}/--no-{k.option.flag}", k.name, default=True, **common)
            elif k.kind is bool:
                option = click.option(flag, k.name, is_flag=True, default=False, **common)
            elif k.required:
                option = click.option(flag, k.name, required=True, **common)
            else:
                default = k.default
                if isinstance(default, enum.Enum):
                    default = default.value
                option = click.option(
                    flag, k.name, type=_click_type(k), default=default, multiple=k.kind is tuple, **common
                )
            command = option(command)
        return command

    return decorate


def _parse_deadline(value: str | None) -> tuple[float | None, bool]:
    if value is None or value == "":
        return None, False
    if value.strip().lower() == "auto":
        return None, True
    try:
        seconds = float(value)
    except ValueError:
        raise click.BadParameter("must be a number of seconds or 'auto'", param_hint="--deadline") from None
    if not seconds > 0:
        raise click.BadParameter("must be > 0 seconds", param_hint="--deadline")
    return seconds, False


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@knob_options(ProxySettings)
# NOTE: --deadline sets two settings (deadline_s, or deadline_auto for 'auto'): spelled by hand.
@click.option(
    "--deadline",
    envvar=env_var("deadline"),
    show_envvar=True,
    default=None,
    help="Clients' deadline on an attempt in seconds (default: learned from the ages at which "
    "clients abandon attempts; 'auto': the same, and --deadline-check may shed by it).",
)
@log_options
def proxy(deadline: str | None, log_level: str, log_format: str, **options: Any) -> None:
    """Run the execution-aware proxy in front of a vLLM engine."""
    from exporter.exchange import ProxyTakeOver
    from exporter.proxy import Proxy
    from foundation.server import serve

    deadline_s, deadline_auto = _parse_deadline(deadline)
    try:
        settings = ProxySettings(deadline_s=deadline_s, deadline_auto=deadline_auto, **options)
    except (SettingsError, PolicyConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    check_port(settings.host, settings.port)
    setup_logging(log_level, log_format, [settings.upstream])
    try:
        app = Proxy(settings)
    except OSError as exc:  # --record DIR that cannot be made or written
        raise click.UsageError(f"--record: {exc}") from None
    announce(
        f"retrywatch proxy on {base_url(settings.host, settings.port)} (metrics /metrics) in front of "
        f"{redact_url(settings.upstream_base)}; state: in memory only"
        + ("" if settings.record is None else f"; recording attempts to {settings.record}")
    )
    serve(
        app.app,
        settings.bounds(),
        app.end_executions,
        log_level,
        chosen_by=_chosen_cap(),
        takeover=ProxyTakeOver(app),
    )


def _chosen_cap() -> str | None:
    """The connection-cap options given on the command line or in the environment, if any:
    a default cap is fitted to the open-file limit, a chosen one is kept (``make_room_for``)."""
    ctx = click.get_current_context()
    defaults = (None, click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)
    chosen = [
        f"--{name.replace('_', '-')}"
        for name in ("max_connections", "reserved_connections")
        if ctx.get_parameter_source(name) not in defaults
    ]
    return " or ".join(chosen) or None
