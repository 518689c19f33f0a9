"""The record a trace reader yields, and the one error every reader raises.

A ``TraceRecord`` is one request of a trace, whatever layout it came from: when it arrived
(seconds from the trace's first request), its prompt and output lengths in tokens, and, where
the layout has them, a call id, a session, a tenant and the ids of its prompt's prefix blocks.
``TraceError`` is a ``ValueError`` whose one-line message names the source, the line and the
column of the first bad row.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TraceError", "TraceRecord", "row_error"]


class TraceError(ValueError):
    """A trace that cannot be read; the message names the line and the column to fix."""


def row_error(source: str, line: int, column: str | None, problem: str) -> TraceError:
    """The one-line error of a bad row: ``SOURCE: line N, column 'C': PROBLEM``."""
    where = f"{source}: line {line}"
    if column is not None:
        where += f", column {column!r}"
    return TraceError(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace.

    ``arrival_s`` counts from the trace's first request (the earliest, after ordering).
    ``prefix_blocks`` are the ids of the prompt's blocks of ``block_tokens`` tokens each, in
    prompt order, the last one possibly partial (Mooncake's ``hash_ids``: equal ids at the same
    position mean a reusable cached prefix); empty, with ``block_tokens`` 0, where the layout has
    none. ``line`` is the record's line in its source, for messages about it later.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    call_id: str | None = None
    session: str | None = None
    tenant: str | None = None
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 0
    line: int = 0

    def arriving_at(self, arrival_s: float) -> TraceRecord:
        """This record arriving at ``arrival_s`` instead (``dataclasses.replace``, without its
        per-field introspection: the stream's hot path rescales and windows every record)."""
        return TraceRecord(
            arrival_s,
            self.prompt_tokens,
            self.output_tokens,
            self.call_id,
            self.session,
            self.tenant,
            self.prefix_blocks,
            self.block_tokens,
            self.line,
        )
