"""Knobs: settings declared once, as dataclass fields that carry their command-line option.

A knob is a dataclass field made by :func:`knob`: its default, and in its metadata the option's
flag, help and bounds. Everything else is derived from those fields: ``exporter.cli`` builds the
click options from them (each with its environment variable ``RETRYWATCH_<FLAG>``), a settings
object checks its bounds with :func:`check_bounds` (naming the flag), and :func:`to_argv` writes
the command line that reproduces a settings object, for every launcher of a proxy process. Adding
an option is one field. A field made with plain ``field()`` (or a bare default) has no option.

Option types follow the field's annotation: ``bool`` (a flag; ``--x/--no-x`` when it defaults to
true), ``int``, ``float``, ``str``, a ``StrEnum`` (one of its values), ``tuple[str, ...]``
(the option repeated), each optionally ``| None`` (unset by default).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from dataclasses import dataclass
from typing import Any

__all__ = ["Knob", "Option", "check_bounds", "env_var", "knob", "knobs", "to_argv"]

ENV_PREFIX = "RETRYWATCH_"
_OPTION = "retrywatch.option"


@dataclass(frozen=True)
class Option:
    """How a knob is spelled on the command line, and the values it accepts."""

    flag: str  # without the dashes: "cancel-after"
    help: str
    minimum: float | None = None
    exclusive: bool = False  # the minimum itself is refused (> rather than >=)
    maximum: float | None = None

    def describe_bounds(self) -> str:
        """What the bounds allow, as a sentence's end: "must be > 0"."""
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum:g}")
        return "must be " + " and ".join(parts) if parts else ""


@dataclass(frozen=True)
class Knob:
    """One optioned field of a settings class, with its annotation resolved."""

    name: str  # the field's name
    option: Option
    kind: type  # bool, int, float, str, a StrEnum subclass, or tuple (of str)
    optional: bool  # ``| None``: None means unset
    default: Any  # dataclasses.MISSING for a required knob

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def knob(
    default: Any = dataclasses.MISSING,
    *,
    flag: str,
    help: str,
    minimum: float | None = None,
    exclusive: bool = False,
    maximum: float | None = None,
) -> Any:
    """A dataclass field with its command-line option (no ``default``: the option is required)."""
    option = Option(flag, help, minimum, exclusive, maximum)
    return dataclasses.field(default=default, metadata={_OPTION: option})


def env_var(flag: str) -> str:
    """The environment variable that sets ``--flag``: ``RETRYWATCH_`` + FLAG with underscores."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def _resolve(annotation: Any) -> tuple[type, bool]:
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return tuple, optional
    if not isinstance(annotation, type):
        raise TypeError(f"a knob cannot be of type {annotation!r}")
    return annotation, optional


_KNOBS: dict[type, tuple[Knob, ...]] = {}


def knobs(cls: type) -> tuple[Knob, ...]:
    """The knobs of a dataclass (inherited ones first), in declaration order."""
    found = _KNOBS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            option = f.metadata.get(_OPTION)
            if isinstance(option, Option):
                kind, optional = _resolve(hints[f.name])
                out.append(Knob(f.name, option, kind, optional, f.default))
        found = _KNOBS[cls] = tuple(out)
    return found


def check_bounds(settings: Any, error: type[Exception]) -> None:
    """Raise ``error`` naming the flag of the first knob of ``settings`` outside its bounds."""
    for k in knobs(type(settings)):
        value = getattr(settings, k.name)
        if value is None or k.kind not in (int, float):
            continue
        o = k.option
        low_ok = o.minimum is None or (value > o.minimum if o.exclusive else value >= o.minimum)
        high_ok = value <= o.maximum if o.maximum is not None else not math.isinf(value)
        if not (low_ok and high_ok) or math.isnan(value):
            raise error(f"--{o.flag} {o.describe_bounds() or 'must be a finite number'}, not {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_argv(settings: Any) -> list[str]:
    """The options that reproduce every knob of ``settings``, defaults included (unset ones
    left out), so a command line says everything it runs with."""
    argv: list[str] = []
    for k in knobs(type(settings)):
        value = getattr(settings, k.name)
        flag = f"--{k.option.flag}"
        if value is None:
            continue
        if k.kind is bool:
            if value:
                argv.append(flag)
            elif k.default is True:
                argv.append(f"--no-{k.option.flag}")
        elif k.kind is tuple:
            for item in value:
                argv += [flag, _text(item)]
        else:
            argv += [flag, _text(value)]
    return argv
