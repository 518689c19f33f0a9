"""One writer per output directory: an advisory lock on a file in it, held while a sweep writes.

``reproduce run`` (``reproduce.runner``) and ``reproduce whatif`` rewrite their DIR's summary
after every finished run, from what they read when they started; two of them in one DIR at once
lose each other's runs. :func:`hold` takes an exclusive ``flock`` on ``DIR/.retrywatch.lock``
and refuses at once (:class:`DirBusy`, naming the holder) when another process has it. The
kernel releases the lock when its holder exits, however it exits (a ``kill -9`` included), so a
killed sweep's DIR is resumed by the next one without clean-up. The file itself stays; it only
says who held the lock last. The thread holding a directory may ``hold`` it again (a what-if
holds its DIR across the steps that each take it).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_FILE", "DirBusy", "hold"]

#: The lock file in a locked directory.
LOCK_FILE = ".retrywatch.lock"
_ARGV_CHARS = 200  # the holder's command line, as far as the refusal quotes it
_HELD: dict[Path, tuple[int, int]] = {}  # directory -> (pid, thread) holding it here


class DirBusy(RuntimeError):
    """Another process (or thread) writes the directory now."""


def _holder() -> str:
    words = [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else []
    command = " ".join(" ".join(words).split())  # one line, whatever the arguments hold
    if len(command) > _ARGV_CHARS:
        command = command[: _ARGV_CHARS - 3] + "..."
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"pid {os.getpid()}, since {since}: {command}"


@contextmanager
def hold(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock (creating the directory) for the ``with`` block; ``DirBusy`` at
    once if another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    holder = (os.getpid(), threading.get_ident())  # a forked child, another thread: not the holder
    if _HELD.get(key) == holder:
        yield
        return
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
            raise DirBusy(
                f"{directory} is being written by another sweep ({held_by}); wait for it to end, "
                "or pick another DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_holder() + "\n").encode("utf-8"), 0)
        _HELD[key] = holder
        try:
            yield
        finally:
            del _HELD[key]
    finally:
        os.close(fd)  # releases the lock (forked workers' copies of it close when they exit)
