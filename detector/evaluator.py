"""Alert evaluation with ``for`` and hysteresis: Prometheus' alerting state machine in Python.

``Evaluator.evaluate(now, frames)`` applies every rule of ``detector/thresholds.py`` to each
engine's :class:`~detector.signals.SignalFrame` and returns the transitions (firing, resolved)
that happened at ``now``. It performs no I/O and reads no clock: the caller passes ``now``
(wall time for live sources, the run's time for a replay).

NOTE: the state machine (:class:`AlertStateMachine`, which the rules' backfill harness runs over
Prometheus' own query results too) is Prometheus 2.42's (rules/alerting.go): a condition that
holds makes an alert pending with ``active_at = now``; it fires at the first evaluation where
``now - active_at >= for``; once firing, a false condition starts ``keep_firing_since`` and the
alert resolves at the first evaluation where ``now - keep_firing_since >= keep_firing_for``
(a true condition clears it); a pending alert whose condition is false is dropped. A missing
signal makes a condition false, as an absent series does in PromQL; the NoData rule reports it.

Engines are keyed by their ``instance`` label (vLLM's ``engine`` label is "0" on every vLLM, so
it cannot tell engines apart); an alert keeps the labels it had when it fired, so its resolve
matches its episode. A scaled run's rules come already scaled (``AlertRule.scaled``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from detector.signals import EngineLabels, SignalFrame
from detector.thresholds import ALERTS, AlertRule, causes_text, engine_model, holds

State = Literal["pending", "firing"]
TransitionKind = Literal["firing", "resolved"]


@dataclass
class AlertStateMachine:
    """Prometheus' alerting state machine for one alert and one label set (see the NOTE above).

    Feed it every evaluation in time order with whether the condition held; it answers the
    transition that evaluation made, if any. ``state`` None: inactive (never active, dropped
    while pending, or resolved; ``fired_at`` keeps the resolved episode's start)."""

    for_s: float
    keep_firing_for_s: float
    state: State | None = None
    active_at: float | None = None
    fired_at: float | None = None
    keep_firing_since: float | None = None

    def step(self, now: float, holds: bool) -> TransitionKind | None:
        if holds:
            if self.state is None:
                self.state, self.active_at, self.fired_at = "pending", now, None
            self.keep_firing_since = None
            assert self.active_at is not None
            if self.state == "pending" and now - self.active_at >= self.for_s:
                self.state, self.fired_at = "firing", now
                return "firing"
            return None
        if self.state == "pending":
            self.state = None
        elif self.state == "firing":
            if self.keep_firing_since is None:
                self.keep_firing_since = now
            if now - self.keep_firing_since >= self.keep_firing_for_s:
                self.state = None
                return "resolved"
        return None


@dataclass
class AlertState:
    """One active (pending or firing) alert for one engine."""

    rule: AlertRule
    labels: EngineLabels
    machine: AlertStateMachine
    value: float | None
    missing: tuple[str, ...] = ()
    causes: tuple[str, ...] = ()  # a symptom alert's: the cause alerts firing on its engine

    @property
    def alertname(self) -> str:
        return self.rule.name

    @property
    def state(self) -> State | None:
        return self.machine.state

    @property
    def active_at(self) -> float | None:
        return self.machine.active_at

    @property
    def fired_at(self) -> float | None:
        return self.machine.fired_at

    @property
    def description(self) -> str:
        return render_description(self.rule, self.labels, self.value, self.missing, self.causes)

    @property
    def resolving_since(self) -> float | None:
        """While a firing alert's condition no longer holds (it keeps firing for
        ``keep_firing_for``): when it stopped holding; else None."""
        return self.machine.keep_firing_since if self.machine.state == "firing" else None

    def as_dict(self) -> dict[str, object]:
        """The shape of ``GET /alerts`` (docs/architecture.md): ``state`` "resolving" while a
        firing alert only keeps firing (its condition cleared at ``resolving_since``; it resolves
        at ``resolves_at`` unless the condition returns), else the machine's state."""
        since = self.resolving_since
        return {
            "alertname": self.rule.name,
            "severity": self.rule.severity,
            "labels": self.labels.as_dict(),
            "state": "resolving" if since is not None else self.state,
            "resolving_since": since,
            "resolves_at": None if since is None else since + self.machine.keep_firing_for_s,
            "started_at": self.fired_at if self.fired_at is not None else self.active_at,
            "value": self.value,
            "summary": self.rule.summary,
            "description": self.description,
        }


@dataclass(frozen=True)
class Transition:
    """An alert started firing or resolved at ``at``."""

    kind: TransitionKind
    alertname: str
    severity: str
    labels: EngineLabels
    at: float
    started_at: float
    value: float | None
    summary: str
    description: str
    extra: dict[str, object] = field(default_factory=dict, compare=False)


def render_description(
    rule: AlertRule,
    labels: EngineLabels,
    value: float | None,
    missing: Sequence[str] = (),
    causes: Sequence[str] = (),
) -> str:
    try:
        return rule.description.format(
            value=value if value is not None else float("nan"),
            missing=", ".join(missing) or "nothing",
            causes=causes_text(causes),
            engine_model=engine_model(labels.engine, labels.model),
            **labels.as_dict(),
        )
    except (ValueError, TypeError):
        return rule.description


class Evaluator:
    """Holds the active alerts between evaluations; feed it frames in time order.

    ``rules``' durations are in the frames' seconds (a scaled run's: ``scale_rules``).
    """

    def __init__(self, rules: Iterable[AlertRule] = ALERTS) -> None:
        self.rules: tuple[AlertRule, ...] = tuple(rules)
        # (alertname, instance) -> state
        self._active: dict[tuple[str, str], AlertState] = {}
        self.last_eval: float | None = None

    def active(self) -> list[AlertState]:
        return list(self._active.values())

    def firing(self) -> list[AlertState]:
        """The firing alerts; safe to call from another thread than the evaluation's (the API's):
        the alerts are copied at once before they are looked at."""
        return [a for a in list(self._active.values()) if a.state == "firing"]

    def restore_firing(
        self, rule_name: str, labels: EngineLabels, fired_at: float, value: float | None
    ) -> None:
        """Re-arm an alert that was firing before a restart (episodes are in the store), so that
        it resolves through the usual hysteresis instead of firing a second time."""
        rule = next(r for r in self.rules if r.name == rule_name)
        machine = AlertStateMachine(
            rule.for_s, rule.keep_firing_for_s, state="firing", active_at=fired_at, fired_at=fired_at
        )
        self._active[(rule_name, labels.instance)] = AlertState(rule, labels, machine, value)

    def shift_time(self, delta: float) -> None:
        """Move the last evaluation and every active alert's times by ``delta`` seconds (the
        caller's clock stepped), so that ``for`` and ``keep_firing_for`` keep counting."""
        if self.last_eval is not None:
            self.last_eval += delta
        for alert in self._active.values():
            m = alert.machine
            m.active_at = None if m.active_at is None else m.active_at + delta
            m.fired_at = None if m.fired_at is None else m.fired_at + delta
            m.keep_firing_since = None if m.keep_firing_since is None else m.keep_firing_since + delta

    def evaluate(self, now: float, frames: Sequence[SignalFrame]) -> list[Transition]:
        if self.last_eval is not None and now < self.last_eval:
            raise ValueError(f"evaluation time went backwards: {now} < {self.last_eval}")
        self.last_eval = now
        out: list[Transition] = []
        for rule in self.rules:
            seen: set[str] = set()
            for frame in frames:
                if not holds(rule.condition, frame.values):
                    continue
                instance = frame.labels.instance
                seen.add(instance)
                key = (rule.name, instance)
                value = frame.values.get(rule.value_signal)
                alert = self._active.get(key)
                if alert is None:
                    machine = AlertStateMachine(rule.for_s, rule.keep_firing_for_s)
                    alert = AlertState(rule, frame.labels, machine, value)
                    self._active[key] = alert
                elif alert.state == "pending":
                    alert.labels = frame.labels  # engine/model may appear after the first scrape
                alert.value = value
                alert.missing = frame.missing_for(rule.tier)
                if rule.kind == "symptom":  # the causes' rules come first: this evaluation's states
                    alert.causes = self._causes_firing(instance)
                if alert.machine.step(now, True) == "firing":
                    out.append(self.transition("firing", alert, now))
            for key, alert in list(self._active.items()):
                if key[0] != rule.name or key[1] in seen:
                    continue
                kind = alert.machine.step(now, False)
                if alert.state is None:
                    del self._active[key]
                if kind == "resolved":
                    out.append(self.transition("resolved", alert, now))
        return out

    def _causes_firing(self, instance: str) -> tuple[str, ...]:
        """The cause alerts firing on ``instance`` now."""
        return tuple(
            a.rule.name
            for (_, inst), a in self._active.items()
            if inst == instance and a.rule.kind == "cause" and a.state == "firing"
        )

    @staticmethod
    def transition(kind: TransitionKind, alert: AlertState, now: float) -> Transition:
        """``alert`` fired or resolved at ``now``."""
        return Transition(
            kind=kind,
            alertname=alert.rule.name,
            severity=alert.rule.severity,
            labels=alert.labels,
            at=now,
            started_at=alert.fired_at if alert.fired_at is not None else now,
            value=alert.value,
            summary=alert.rule.summary,
            description=alert.description,
        )
