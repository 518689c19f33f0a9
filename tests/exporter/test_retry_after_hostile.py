"""The upstream's Retry-After as a hostile upstream may send it: whatever its bytes, what the
proxy passes on to its clients (``exporter.execution.retry_after``) is delta-seconds or an
IMF-fixdate, never the upstream's bytes themselves (``test_proxy_overload.py`` has the values
passed on end to end)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.execution import RETRY_AFTER_MAX_BYTES, retry_after

PASSED_ON = re.compile(
    rb"\d{1,%d}|(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
    rb"\d{4} \d\d:\d\d:\d\d GMT" % RETRY_AFTER_MAX_BYTES
)
# Pieces of dates and of what breaks a header field: a date-like value reaches the date parser.
PIECES = st.sampled_from(
    [b"Wed,", b"21", b"Oct", b"2015", b"07:28:00", b"GMT", b"UT", b"+0000", b"-0000", b"+9999", b"99999",
     b"0", b"-1", b"31", b"Feb", b"24:00:00", b"\r\n", b"\n", b"\x00", b"\xff", b"\t", b"x-injected: 1"]
)  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.binary(max_size=RETRY_AFTER_MAX_BYTES + 8), st.lists(PIECES, max_size=9).map(b" ".join)))
def test_what_is_passed_on_is_delta_seconds_or_an_imf_fixdate(value: bytes) -> None:
    passed_on = retry_after([(b"retry-after", value)])
    assert passed_on is None or PASSED_ON.fullmatch(passed_on), (value, passed_on)
