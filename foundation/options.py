"""Option types every retrywatch command line shares."""

from __future__ import annotations

import math
from typing import Any

import click

from foundation.bounds import EMPTY_HOST, host_is_usable


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that refuses NaN (which passes every bound) and, unless ``allow_inf``,
    infinity: a usage error (exit 2), never a traceback later. The CLIs' float options use it."""

    def __init__(self, *args: Any, allow_inf: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_inf = allow_inf

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if math.isnan(rv) or (math.isinf(rv) and not self.allow_inf):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


def listen_host(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--host`` of a serving command: an empty one is a usage error (``foundation.bounds``)."""
    if not host_is_usable(value):
        raise click.BadParameter(EMPTY_HOST)
    return value
