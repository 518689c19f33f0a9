"""What each alert reads: the raw series behind its signals, derived from their declarations.

Every signal is declared once (``detector/signals.py``) with the PromQL of its recording rule, a
derived ratio's rendered from its ``foundation.ratios`` definition over the records of the signals
it reads. This module reads those expressions, follows every record they name down to the raw
series (vLLM's, the proxy's, ``up``), and so answers, for a signal or an alert
(``detector/thresholds.py``), which series it needs, with no list kept by hand.

A need is a set of alternatives, each a set of series all needed (:data:`Need`): PromQL's ``or``
gives alternatives (Ĉ stated, learned online at saturation, or predicted from vLLM's counters),
every other operator needs both sides. A series is written as the rules select it
(``retrywatch_attempts_total{kind="first"}``, ``vllm:e2e_request_latency_seconds_bucket``: its
bucket is the one at the deadline in force) without its ``job`` matcher. The two records the
signals read whose PromQL only the rules hold (``rules.learned``: Ĉ predicted, the deadline's
bucket) stand for the raw series ``detector.signals.RULES_ONLY_RECORDS`` names.

NOTE on what is not followed:
- ``X unless Y``: an alternative that evaluates only while ``Y`` is absent (the vLLM tier's delivery
  error answers 0 while nothing has finished) is left out: nothing can count on it;
- a record computed over at least the Ĉ estimate's window (``avg_over_time(...[1h])``) is a learned
  value, a series of its own (:func:`is_learned`), not its inputs: it exists only after an hour of
  saturated history;
- comparisons with a constant (``> 0``) filter values, not series: a series present is enough.

The Python evaluator (``SignalEngine``) needs no more than the rules: it reads the same series,
and where a ratio sums several signals it counts a missing one as zero (``foundation.ratios``),
where PromQL's ``+`` needs both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from detector.signals import (
    HELPER_RECORDS,
    RULES_ONLY_RECORDS,
    SERVED_NAMES,
    SIGNALS,
    SIGNALS_BY_NAME,
    UP,
    WINDOWS,
)
from detector.thresholds import AlertRule, Condition, leaves
from foundation.vllmreleases import canonical_name

__all__ = ["Need", "Selector", "alert_series", "expression_needs", "is_learned", "signal_needs"]

#: Alternatives, each a set of series (as :class:`Selector` text) all needed; empty: never.
Need = frozenset[frozenset[str]]
_ALWAYS: Need = frozenset({frozenset()})

# record -> its expression, every tier's
_RECORDS: dict[str, str] = {
    **{record: expr for helpers in HELPER_RECORDS.values() for record, expr in helpers},
    **{spec.record: spec.promql for spec in SIGNALS},
}
_RAW_NAMES: frozenset[str] = SERVED_NAMES
_NAME = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
_RANGE = re.compile(r"\[(\d+)([smhd])\]")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Selector:
    """One series as the rules select it: a name and its label matchers (``job`` left out)."""

    name: str
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value), sorted

    @classmethod
    def parse(cls, text: str) -> Selector:
        name, _, rest = text.partition("{")
        matchers = tuple(sorted((m[1], m[2], m[3]) for m in _MATCHER.finditer(rest) if m[1] != "job"))
        return cls(name, matchers)

    def __str__(self) -> str:
        if not self.matchers:
            return self.name
        return self.name + "{" + ",".join(f'{k}{op}"{v}"' for k, op, v in self.matchers) + "}"

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        """Whether a sample ``name{labels}`` is one of this selector's series."""
        if name != self.name:
            return False
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            hit = re.fullmatch(value, have) is not None if op in ("=~", "!~") else have == value
            if hit != (op in ("=", "=~")):
                return False
        return True


def is_learned(record: str) -> bool:
    """Whether ``record`` is learned over at least the Ĉ estimate's window (see the NOTE)."""
    expr = _RECORDS.get(record, "")
    return any(int(n) * _UNIT_S[u] >= WINDOWS.capacity_estimate_s for n, u in _RANGE.findall(expr))


def _product(a: Need, b: Need) -> Need:
    return _minimal(x | y for x in a for y in b)


def _minimal(alternatives: Iterable[frozenset[str]]) -> Need:
    """The alternatives that need no more than another (a superset adds nothing)."""
    alts = set(alternatives)
    return frozenset(a for a in alts if not any(b < a for b in alts))


def _split(expr: str, words: tuple[str, ...]) -> list[tuple[str, str]]:
    """``expr`` cut at its top-level binary ``words`` (outside parentheses, braces, brackets
    and strings): [(the word before, or "", text)]."""
    out: list[tuple[str, str]] = []
    depth, start, word, i, quoted = 0, 0, "", 0, False
    while i < len(expr):
        c = expr[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0 and c == " ":
            for w in words:
                if expr.startswith(f" {w} ", i):
                    out.append((word, expr[start:i]))
                    word, i = w, i + len(w) + 1
                    start = i + 1
                    break
        i += 1
    out.append((word, expr[start:]))
    return out


def _segment(text: str) -> Need:
    """The need of an expression without top-level ``or``/``and``/``unless``: its series outside
    parentheses, and each parenthesized group's need."""
    need = _ALWAYS
    flat: list[str] = []
    depth, open_at, quoted = 0, 0, False
    for i, c in enumerate(text):
        if quoted:
            quoted = c != '"' or text[i - 1] == "\\"
        elif c == '"':
            quoted = True
        elif c == "(":
            if depth == 0:
                open_at = i
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                need = _product(need, expression_needs(text[open_at + 1 : i]))
                continue
        if depth == 0 and c != ")":
            flat.append(c)
    bare = _RANGE.sub("", "".join(flat))
    for m in _NAME.finditer(bare):
        name = m[1]
        if name in _RAW_NAMES:
            need = _product(need, frozenset({frozenset({str(Selector.parse(m[0]))})}))
        elif name in _RECORDS:
            need = _product(need, _record_needs(name))
        elif name in RULES_ONLY_RECORDS:
            need = _product(need, frozenset({frozenset(RULES_ONLY_RECORDS[name])}))
    return need


@cache
def _record_needs(record: str) -> Need:
    if is_learned(record):
        return frozenset({frozenset({record})})
    return expression_needs(_RECORDS[record])


@cache
def expression_needs(expr: str) -> Need:
    """The raw series (and learned records) a PromQL expression of the rules reads."""
    out: set[frozenset[str]] = set()
    for _, alternative in _split(expr, ("or",)):
        terms = _split(alternative, ("and", "unless"))
        if any(word == "unless" for word, _ in terms):
            continue  # evaluates only while a series is absent: see the NOTE
        need = _ALWAYS
        for _, term in terms:
            need = _product(need, _segment(term))
        out |= need
    return _minimal(out)


def signal_needs(signal: str) -> Need:
    """What ``signal`` reads (its recording rule, followed down to the raw series)."""
    return expression_needs(SIGNALS_BY_NAME[signal].promql)


def _signals(cond: Condition) -> list[str]:
    return list(dict.fromkeys(leaf.signal for leaf in leaves(cond)))


def alert_series(rule: AlertRule) -> tuple[str, ...]:
    """Every raw series name ``rule`` may read, through any alternative, sorted (``up`` and
    learned records left out; an older vLLM's name for one as the name it stands for)."""
    names = {
        canonical_name(Selector.parse(series).name)
        for signal in _signals(rule.condition)
        for alt in signal_needs(signal)
        for series in alt
    }
    return tuple(sorted(n for n in names if n in _RAW_NAMES and n != UP))
