"""A reproduce output directory (``DIR/``): the one reader of ``DIR/summary.json``,
``DIR/validation.json``, a what-if's ``DIR/whatif.json`` and the runs' metrics series paths,
with the one error class.

``retrywatch reproduce run`` writes the directory (``reproduce/judge/summary.py``; shapes in
docs/architecture.md); the alerts' validation (``reproduce/judge/validate.py``), the dashboard's
Experiments page, the rules' equivalence check and the reproduce report and runner read it
through this module.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DERIVED",
    "MAX_JSON_BYTES",
    "REPORT_HTML",
    "REPORT_MD",
    "RULES_VALIDATION",
    "RULES_VALIDATION_MD",
    "SUMMARY",
    "VALIDATION",
    "VALIDATION_MD",
    "VALIDATION_NOTHING_STATED",
    "VALIDATION_NOTHING_STATED_MD",
    "WHATIF",
    "WHATIF_POINTS",
    "NotARunDir",
    "RunDirError",
    "read_json",
    "read_summary",
    "read_validation",
    "read_whatif",
    "regular_file",
    "run_slug",
    "series_path",
]

SUMMARY = "summary.json"
VALIDATION = "validation.json"
VALIDATION_MD = "validation.md"
#: ``reproduce validate --rules FILE``: another rule file's alerts scored over the runs.
RULES_VALIDATION = "rules-validation.json"
RULES_VALIDATION_MD = "rules-validation.md"
#: ``reproduce validate --nothing-stated``'s, beside the stated one.
VALIDATION_NOTHING_STATED = "validation-nothing-stated.json"
VALIDATION_NOTHING_STATED_MD = "validation-nothing-stated.md"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
#: ``retrywatch reproduce whatif``'s result: policies side by side and each one's headroom.
WHATIF = "whatif.json"
#: The folder of a what-if's DIR that holds its runs (a reproduce output directory of its own).
WHATIF_POINTS = "points"
#: What ``reproduce validate`` and ``reproduce report`` derive from the runs of a DIR: stale once
#: its runs change, so ``reproduce run`` removes them.
DERIVED = (
    VALIDATION,
    VALIDATION_MD,
    VALIDATION_NOTHING_STATED,
    VALIDATION_NOTHING_STATED_MD,
    RULES_VALIDATION,
    RULES_VALIDATION_MD,
    REPORT_MD,
    REPORT_HTML,
)
#: The largest JSON file of a DIR read (a summary of 5000 runs is ~10 MB).
MAX_JSON_BYTES = 64 * 1024 * 1024
# What a path that is not a regular file is, for the message (anything else: "not a regular file").
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class RunDirError(ValueError):
    """A reproduce output directory is missing a file or holds JSON of the wrong shape; the
    message names the file (and the run) and what is wrong."""


class NotARunDir(RunDirError):
    """The directory is not a reproduce output directory (it or its ``summary.json`` is missing):
    a usage mistake, which a command reports as one (exit 2) before it creates anything."""


def regular_file(path: Path, root: Path, max_bytes: int) -> Path:
    """``path``, checked without opening it: a regular file (after symlinks) inside ``root`` of
    at most ``max_bytes``; otherwise RunDirError saying what it is. A FIFO, a device or a socket
    is never opened (opening one for reading can wait forever), nor a file outside ``root``.

    NOTE: a file swapped for a FIFO between this check and its read is not covered; ``read_json``
    below is, by opening without waiting and checking the open file again."""
    resolved = path.resolve()
    if root.resolve() not in resolved.parents:
        raise RunDirError(f"{path} leads outside the runs directory {root}")
    try:
        found = os.stat(resolved)
    except FileNotFoundError as exc:
        raise RunDirError(f"{path} does not exist") from exc
    _check_stat(path, found, max_bytes)
    return resolved


def _check_stat(path: Path, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "something else")
        raise RunDirError(f"{path} is not a regular file ({kind}); it is not read")
    if st.st_size > max_bytes:
        raise RunDirError(f"{path} is {st.st_size} bytes, over the {max_bytes}-byte bound; it is not read")


def read_json(path: Path, root: Path) -> Any:
    """``path``'s JSON, read only if it is a regular file inside ``root`` (``regular_file``)."""
    resolved = regular_file(path, root, MAX_JSON_BYTES)
    # O_NONBLOCK: a file swapped for a FIFO since the check opens at once instead of waiting
    # for a writer, and the check on the open file refuses it.
    fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as fh:
        _check_stat(path, os.fstat(fd), MAX_JSON_BYTES)
        raw = fh.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise RunDirError(f"{path} is over the {MAX_JSON_BYTES}-byte bound; it is not read")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{path} is not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc})") from exc


def read_summary(out: Path) -> dict[str, Any]:
    """``out/summary.json``: ``{"runs": [...], ...}``."""
    if not out.is_dir():
        raise NotARunDir(f"runs directory {out} does not exist")
    path = out / SUMMARY
    if not path.exists():
        raise NotARunDir(
            f"{path}: not found; {SUMMARY} does not exist until `retrywatch reproduce run ... --out {out}`"
            " writes it"
        )
    data = read_json(path, out)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise RunDirError(f"{path} must hold {{'runs': [...]}}")
    return data


def read_validation(out: Path) -> dict[str, Any] | None:
    """``out/validation.json`` (``retrywatch reproduce validate``), or None if it is not there."""
    path = out / VALIDATION
    if not path.exists():
        return None
    data = read_json(path, out)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise RunDirError(f"{path} must hold {{'runs': [...]}}")
    return data


def read_whatif(out: Path) -> dict[str, Any] | None:
    """``out/whatif.json`` (``retrywatch reproduce whatif``), or None if it is not there."""
    path = out / WHATIF
    if not path.exists():
        return None
    data = read_json(path, out)
    if not isinstance(data, dict) or not isinstance(data.get("policies"), dict):
        raise RunDirError(f"{path} must hold {{'policies': {{...}}}}")
    return data


def run_slug(run: Mapping[str, Any]) -> str:
    """A run's identifier: ``block__condition__model__r<run>``, the name of its folder."""
    series = run.get("series")
    if series:
        return Path(str(series)).parent.name or str(series)
    return (
        f"{run.get('block', '')}__{run.get('condition', '')}__{run.get('model', '')}__r{run.get('run', '')}"
    )


def series_path(out: Path, run: Mapping[str, Any], *, must_exist: bool = False) -> Path:
    """The run's metrics series (``run["series"]``, relative to ``out``), which must stay
    inside ``out`` (and exist, with ``must_exist``)."""
    rel = run.get("series")
    if not rel:
        raise RunDirError(f"{out / SUMMARY}: run {run_slug(run)!r} names no metrics series")
    path = (out / str(rel)).resolve()
    if out.resolve() not in path.parents:
        raise RunDirError(f"{out / SUMMARY}: series path {rel!r} leaves the runs directory")
    if must_exist and not path.is_file():
        raise RunDirError(f"{out / SUMMARY}: series file {path} of run {run_slug(run)!r} not found")
    return path
