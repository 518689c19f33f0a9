"""Alert episodes: one firing of one alert for one engine, from firing to resolved.

:class:`EpisodeLog` folds the evaluator's transitions into episodes in memory (the replay
path); ``detector/store.py`` persists the same records in SQL (the live path).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from detector.evaluator import Transition
from detector.signals import EngineLabels

#: A resolved episode is kept this many days, then deleted with its notification rows
#: (``retrywatch detect --retention``; 0 keeps every one).
DEFAULT_RETENTION_DAYS = 90.0


@dataclass
class AlertEpisode:
    """A fired alert. Times are those of the evaluation clock (Unix seconds live, seconds from
    the run's start in a replay); ``resolved_at`` is None while it fires."""

    alertname: str
    severity: str
    labels: EngineLabels
    started_at: float
    resolved_at: float | None
    summary: str
    description: str
    value: float | None
    id: int | None = None

    def as_dict(self) -> dict[str, object]:
        """The shape of ``GET /episodes`` (docs/architecture.md)."""
        return {
            "id": self.id,
            "alertname": self.alertname,
            "severity": self.severity,
            "labels": self.labels.as_dict(),
            "started_at": self.started_at,
            "resolved_at": self.resolved_at,
            "summary": self.summary,
            "description": self.description,
            "value": self.value,
        }


class EpisodeLog:
    """Episodes built from transitions, in the order they fired."""

    def __init__(self) -> None:
        self.episodes: list[AlertEpisode] = []
        self._open: dict[tuple[str, str], AlertEpisode] = {}  # (alertname, instance) -> episode

    def apply(self, transitions: Iterable[Transition]) -> None:
        for tr in transitions:
            key = (tr.alertname, tr.labels.instance)
            if tr.kind == "firing":
                ep = AlertEpisode(
                    alertname=tr.alertname,
                    severity=tr.severity,
                    labels=tr.labels,
                    started_at=tr.started_at,
                    resolved_at=None,
                    summary=tr.summary,
                    description=tr.description,
                    value=tr.value,
                    id=len(self.episodes) + 1,
                )
                self.episodes.append(ep)
                self._open[key] = ep
            else:
                ep_open = self._open.pop(key, None)
                if ep_open is not None:
                    ep_open.resolved_at = tr.at
                    ep_open.value = tr.value
