"""A soak of a real ``retrywatch proxy`` process in front of the real test upstream: thousands of
calls of every kind, many at once (``tests.exporter.soak``), then every check of the soak (each
answer its own call's and whole, or ended by an error event; the counter balance; nothing live;
one upstream request per dispatched execution) and flat descriptors and memory. The same soak,
bigger: ``python bench/soak_proxy.py --calls 10000``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.exporter.soak import FATES, KINDS, SOAK_PROXY_ARGS, run_soak
from tests.exporter.support import Upstream, errors_logged, proxy_process

CALLS = 4_000
WARMUP_CALLS = 1_000
CONCURRENCY = 100
# After the warm-up the proxy's resting descriptors (listening socket, event loop, a pooled
# upstream connection or two) stay put; a leak of one per call, or per upstream connection
# expired, adds hundreds.
MAX_FD_GROWTH = 16
# The proxy remembers every call key for 15 minutes (up to 200,000 keys), about 400 B a call
# here; a leak of a few KB per call (an execution's relay kept, say: about 2.7 KB) breaks this.
MAX_RSS_GROWTH_PER_CALL = 1024


@pytest.mark.slow
def test_a_soak_of_every_kind_of_call_leaves_the_proxy_correct_balanced_and_flat(
    upstream: Upstream, tmp_path: Path
) -> None:
    log = tmp_path / "proxy.log"
    with proxy_process(upstream.url, *SOAK_PROXY_ARGS, "--drain-timeout", "0", log=log) as p:
        report = run_soak(p.url, p.proc.pid, upstream.url, CALLS, WARMUP_CALLS, CONCURRENCY, seed=0)
    text = "\n".join(report.lines())
    print(text)
    assert report.problems == [], text
    assert errors_logged(log) == [], log.read_text()[-5000:]  # nothing failed inside the proxy
    f = report.figures
    # Every kind of call happened, and every way an execution ends, and a retry both attached to
    # its call's execution and created its own.
    assert sorted(f["kinds"]) == sorted(KINDS), text
    assert all(f["fates"][fate] > 0 for fate in FATES), text
    assert f["retries_attached"] > 0 and f["retries_created"] > 0, text
    warm, soaked = report.warmup.resources, report.soak.resources
    assert soaked.fds - warm.fds <= MAX_FD_GROWTH, text
    assert f["rss_bytes_per_call"] <= MAX_RSS_GROWTH_PER_CALL, text
