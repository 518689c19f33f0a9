"""Run many (block, condition, model, run) combinations and write ``DIR/summary.json``.

Parallel backends (the simulator) run in ``jobs`` worker processes; the others run one at a
time. A progress bar (tqdm) counts runs. The summary is rewritten after every finished run, so
an interrupted invocation keeps what it finished; entries of other runs already in ``DIR``
(another block run into the same folder) are kept, and a rerun replaces its own by slug; a
summary there that cannot be read is an error, never replaced. Nothing is created before the
backend's ``prepare`` accepts the runs; a validation or report there (``foundation.rundir.DERIVED``)
is removed, as it describes the runs before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from tqdm import tqdm

from foundation.rundir import DERIVED, SUMMARY, read_summary
from reproduce.conditions import RunSpec
from reproduce.registry import Backend, RunJob
from reproduce.summary import write_summary

__all__ = ["run_many"]


def _execute(backend: Backend, job: RunJob) -> dict[str, Any]:
    return backend.run(job)


def _existing(out: Path) -> list[dict[str, Any]]:
    """The runs of ``out/summary.json``, or none if there is none; a summary that cannot be read
    raises ``RunDirError`` (its runs would be lost if it were replaced)."""
    if not (out / SUMMARY).exists():
        return []
    return [r for r in read_summary(out)["runs"] if isinstance(r, dict)]


def run_many(
    backend: Backend,
    runs: Sequence[RunSpec],
    out: Path,
    *,
    jobs: int = 1,
    time_scale: float = 1.0,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Execute ``runs`` with ``backend``; return their summary entries in the order given."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    if not runs:
        raise ValueError("no runs to execute")
    own = {r.slug for r in runs}
    kept = [r for r in _existing(out) if r.get("slug") not in own]
    done: dict[str, dict[str, Any]] = {}
    full_meta = {"backend": backend.name, "time_scale": time_scale, **(meta or {})}

    def finished(entry: dict[str, Any]) -> None:
        done[entry["slug"]] = entry
        ordered = [done[r.slug] for r in runs if r.slug in done]
        write_summary(out, [*kept, *ordered], full_meta)

    backend.prepare(runs, time_scale)  # before anything is created: it checks the runs' models
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in DERIVED:  # a validation or report of the runs before these would be stale
            (out / name).unlink(missing_ok=True)
        bar = tqdm(total=len(runs), unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True)
        with bar:
            if backend.parallel and jobs > 1 and len(runs) > 1:
                with ProcessPoolExecutor(max_workers=min(jobs, len(runs))) as pool:
                    futures = [pool.submit(_execute, backend, RunJob(r, out, time_scale)) for r in runs]
                    for future in as_completed(futures):
                        finished(future.result())
                        bar.update(1)
            else:
                for r in runs:
                    finished(_execute(backend, RunJob(r, out, time_scale)))
                    bar.update(1)
    finally:
        backend.close()
    return [done[r.slug] for r in runs]
