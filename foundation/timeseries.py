"""The metrics time-series format every backend writes and the detector replays.

A run's series is a JSON-lines file; each line is one scrape::

    {"t": 5.0, "samples": [["retrywatch_attempts_total", {"kind": "first"}, 12.0], ...]}

``t`` is seconds from the run's start (simulated or wall time); ``samples`` holds exactly what
a scrape of the proxy's ``/metrics`` (retrywatch_* and vLLM's passthrough) would return at that
moment, with the real names and labels. Counters are cumulative. Of the histograms, vLLM's
families in ``foundation.vllmbuckets.SERIES_HISTOGRAMS`` are kept (``_bucket`` with ``le``,
``_count``, ``_sum``, as Prometheus stores them); the others are dropped.

NOTE (size): in a line, each histogram series (one family, one label set) whose buckets, count
and sum are all present is written once, compactly, under ``"histograms"``::

    "histograms": [["vllm:e2e_request_latency_seconds", {"engine": "0"}, ["0.3", ..., "+Inf"],
                    [0.0, ..., 4.0], 4.0, 31.5]]

(family, labels without ``le``, the ``le`` values, the cumulative bucket counts, the count, the
sum), about 6 times shorter than as samples. Reading expands them back into ``_bucket``,
``_count`` and ``_sum`` samples after the line's other samples; readers see samples only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]
Sample = tuple[str, dict[str, str], float]


@dataclass
class Snapshot:
    """One scrape: every sample at time ``t`` (seconds from the run's start)."""

    t: float
    samples: list[Sample] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the samples named ``name`` whose labels include ``labels``; None if none."""
        total: float | None = None
        for sample_name, sample_labels, value in self.samples:
            if sample_name != name:
                continue
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                total = value if total is None else total + value
        return total

    def to_json(self) -> str:
        flat, histograms = _fold_histograms(self.samples)
        obj: dict[str, object] = {
            "t": self.t,
            "samples": [[n, dict(lb), _finite_or_none(v)] for n, lb, v in flat],
        }
        if histograms:
            obj["histograms"] = histograms
        return json.dumps(obj, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Snapshot:
        obj = json.loads(line)
        samples: list[Sample] = [
            (str(n), {str(k): str(v) for k, v in lb.items()}, _number(v)) for n, lb, v in obj["samples"]
        ]
        for family, lb, les, buckets, count, total in obj.get("histograms", ()):
            labels = {str(k): str(v) for k, v in lb.items()}
            if len(les) != len(buckets):
                raise ValueError(f"histogram {family!r}: {len(les)} le values for {len(buckets)} buckets")
            samples.extend(
                (f"{family}_bucket", {**labels, "le": str(le)}, _number(v))
                for le, v in zip(les, buckets, strict=True)
            )
            samples.append((f"{family}_count", dict(labels), _number(count)))
            samples.append((f"{family}_sum", labels, _number(total)))
        return cls(t=float(obj["t"]), samples=samples)


def _number(value: object) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"not a sample value: {value!r}")
    return float(value)


_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _fold_histograms(samples: list[Sample]) -> tuple[list[Sample], list[list[object]]]:
    """Split ``samples`` into the flat ones and the compact histogram series (module NOTE).

    A series is folded only when it is whole (buckets, one count, one sum, no ``le`` twice), so
    reading a line back gives the same samples, histograms last in Prometheus' order."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[int]] = {}
    for i, (name, labels, _) in enumerate(samples):
        if name.endswith(_HISTOGRAM_SUFFIXES):
            groups.setdefault(_series_key(name, labels), []).append(i)
    if not groups:
        return samples, []
    folded: set[int] = set()
    out: list[list[object]] = []
    for (family, key), idxs in groups.items():
        les: list[str] = []
        buckets: list[float | None] = []
        count: list[float] = []
        total: list[float] = []
        for i in idxs:
            name, labels, value = samples[i]
            if name.endswith("_bucket"):
                les.append(labels["le"])
                buckets.append(_finite_or_none(value))
            elif name.endswith("_count"):
                count.append(value)
            else:
                total.append(value)
        if not les or len(count) != 1 or len(total) != 1 or len(set(les)) != len(les):
            continue
        folded.update(idxs)
        out.append([family, dict(key), les, buckets, _finite_or_none(count[0]), _finite_or_none(total[0])])
    flat = [s for i, s in enumerate(samples) if i not in folded] if folded else samples
    return flat, out


def _series_key(name: str, labels: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(family, labels without ``le``) of a ``_bucket``/``_count``/``_sum`` sample; a ``_bucket``
    without ``le`` gets a key no count or sum shares, so it is never folded."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            family = name[: -len(suffix)]
            break
    if suffix == "_bucket" and "le" not in labels:
        return name, (("", ""),)
    return family, tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_snapshot(fh: IO[str], snapshot: Snapshot) -> None:
    fh.write(snapshot.to_json())
    fh.write("\n")


def write_series(path: Path, snapshots: Iterable[Snapshot]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for snapshot in snapshots:
            write_snapshot(fh, snapshot)


def read_series(path: Path) -> Iterator[Snapshot]:
    """Yield the snapshots of a series file in order; a clear error names a bad line."""
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield Snapshot.from_json(line)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:  # a bad field
                raise ValueError(f"{path}:{lineno}: not a metrics snapshot ({exc})") from exc


class ExpositionRefused(ValueError):
    """An exposition a scrape refuses whole, as Prometheus fails a scrape past its
    ``sample_limit``: every sample of the answer is dropped. ``reason`` names why (a label value of
    the detector's ``retrywatch_detector_scrapes_refused_total``)."""

    reason = "refused"


class TooManySeries(ExpositionRefused):
    """More series than the scrape's limit (``parse_exposition``'s ``max_series``)."""

    reason = "series_limit"


class DuplicateSeries(ExpositionRefused):
    """One series (a name and a label set) twice in one exposition: which sample is the series'
    value is anyone's guess, and a reader that sums by labels counts it twice."""

    reason = "duplicate_series"


#: The longest series text an error quotes (a label value may be long).
_QUOTED_CHARS = 200


def _series_text(name: str, labels: Labels) -> str:
    text = format_sample(name, labels, 0.0).rsplit(" ", 1)[0]
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


def parse_exposition(
    text: str,
    *,
    keep_histograms: bool | Collection[str] = False,
    max_series: int | None = None,
    unique: bool = False,
) -> list[Sample]:
    """Parse Prometheus plain-text exposition (colons kept) into samples.

    Counters keep their ``_total`` name; histogram and summary series are dropped unless
    ``keep_histograms`` is True (all of them) or a collection of family names (those:
    a metrics series keeps ``foundation.vllmbuckets.SERIES_HISTOGRAMS``).

    A scrape's checks, over every sample of the text (those dropped too, as Prometheus counts
    them): more than ``max_series`` samples raise :class:`TooManySeries` (parsing stops there);
    with ``unique``, a series twice raises :class:`DuplicateSeries` naming it.
    """
    samples: list[Sample] = []
    keep_all = keep_histograms is True
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    count = 0
    for family in text_string_to_metric_families(text):
        is_distribution = family.type in ("histogram", "summary", "gaugehistogram")
        keep = (
            not is_distribution
            or keep_all
            or (not isinstance(keep_histograms, bool) and family.name in keep_histograms)
        )
        for s in family.samples:
            count += 1
            if max_series is not None and count > max_series:
                raise TooManySeries(f"more than {max_series} series (the series limit)")
            if unique:
                key = (s.name, frozenset(s.labels.items()))
                if key in seen:
                    raise DuplicateSeries(f"the series {_series_text(s.name, s.labels)} appears twice")
                seen.add(key)
            if keep and not s.name.endswith("_created"):
                samples.append((s.name, dict(s.labels), float(s.value)))
    return samples


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_sample(name: str, labels: Labels, value: float) -> str:
    """One exposition line (shared by the OpenMetrics writer and tests)."""
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} {value!r}"
    return f"{name} {value!r}"


def to_openmetrics(
    snapshots: Iterable[Snapshot], *, start_unix_s: float, extra_labels: Labels | None = None
) -> str:
    """Render a series as OpenMetrics text with timestamps, for
    ``promtool tsdb create-blocks-from openmetrics``. Every series is typed ``gauge`` because
    the OpenMetrics parser requires counters to end in ``_total`` and forbids colons in
    counter family names; Prometheus' rate() works on gauges all the same.
    """
    by_series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = {}
    for snap in snapshots:
        for name, labels, value in snap.samples:
            merged = {**labels, **(extra_labels or {})}
            key = (name, tuple(sorted(merged.items())))
            by_series.setdefault(key, []).append((start_unix_s + snap.t, value))
    lines: list[str] = []
    families: dict[str, list[tuple[tuple[tuple[str, str], ...], list[tuple[float, float]]]]] = {}
    for (name, series_labels), points in by_series.items():
        families.setdefault(name, []).append((series_labels, points))
    for name in sorted(families):
        lines.append(f"# TYPE {name} gauge")
        for series_labels, points in families[name]:
            for ts, value in points:
                if math.isnan(value):
                    continue
                lines.append(f"{format_sample(name, dict(series_labels), value)} {ts:.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"
