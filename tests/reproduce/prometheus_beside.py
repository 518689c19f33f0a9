"""A real Prometheus (Debian's ``prometheus``) beside a scaled run of the real-vLLM tests: it
scrapes vLLM directly (the vLLM tier's job) and each run's proxy (the proxy tier's job, found
through the file the HTTP backend writes, ``prometheus_targets``), evaluates the rules at the
run's time scale (``rules.scaled``) with the operator's two numbers stated as series, and answers
which alerts fired, where and when, from its HTTP API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from detector.signals import PROMETHEUS_JOBS
from foundation import metricnames as mn
from foundation.processes import ManagedProcess, free_port
from rules.scaled import lookback_delta, write_scaled
from tests.systemtools import require

# The scrape interval beside a scaled run: every window the rules read still holds several scrapes
# (the shortest, 60 s at K = 10, holds six), and the engine on a shared CPU is not scraped harder
# than the harness already does.
SCRAPE_INTERVAL_S = 1.0
# vLLM serves its /metrics with prometheus_client's ASGI app, which answers Prometheus' request
# for OpenMetrics with every colon in a sample's name written as "_" (vllm:num_requests_waiting
# arrives as vllm_num_requests_waiting); the scrape puts vLLM's names back. Every vLLM family is
# named "vllm:..." (none "vllm_...").
VLLM_NAMES_BACK = (
    "    metric_relabel_configs:\n"
    "      - {source_labels: [__name__], regex: 'vllm_(.*)', target_label: __name__, "
    "replacement: 'vllm:$1'}\n"
)


@dataclass(frozen=True)
class Prometheus:
    url: str
    vllm_instance: str

    def firing(self, start: float, end: float) -> list[dict[str, Any]]:
        """Every alert series firing at some evaluation in [start, end] (Unix seconds): its name,
        instance and target (vLLM scraped directly, or a proxy), and its first and last firing
        sample, in seconds after ``start``. Alerts carry no ``job`` (the rules aggregate by
        instance): vLLM's instance tells them apart."""
        answer = httpx.get(
            f"{self.url}/api/v1/query_range",
            params={"query": 'ALERTS{alertstate="firing"}', "start": start, "end": end, "step": 0.5},
            timeout=30,
        )
        answer.raise_for_status()
        out = []
        for series in answer.json()["data"]["result"]:
            times = [float(t) for t, _ in series["values"]]
            labels = series["metric"]
            out.append(
                {
                    "alertname": labels["alertname"],
                    "instance": labels.get("instance", ""),
                    # whose scrape it fired on: vLLM's own (the vLLM tier's job) or a proxy's
                    "target": "vllm" if labels.get("instance") == self.vllm_instance else "proxy",
                    "first_firing_s": round(min(times) - start, 3),
                    "last_firing_s": round(max(times) - start, 3),
                }
            )
        return sorted(out, key=lambda a: (a["first_firing_s"], a["alertname"]))


@contextmanager
def prometheus_beside(
    workdir: Path, *, engine_url: str, targets: Path, time_scale: float, capacity: float, deadline_s: float
) -> Iterator[Prometheus]:
    """Prometheus scraping vLLM at ``engine_url`` and the proxies listed in ``targets``, with the
    rules at ``time_scale`` and the operator's Ĉ and deadline stated for vLLM's instance."""
    binary = require("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    targets.write_text("[]\n", encoding="utf-8")
    instance = urlsplit(engine_url).netloc
    rules = write_scaled(workdir / "scaled.rules.yml", time_scale)
    stated = workdir / "stated.rules.yml"
    # What an operator without the proxy states (the proxy exports both for its own instance).
    stated.write_text(
        json.dumps(
            {
                "groups": [
                    {
                        "name": "stated",
                        "rules": [
                            {
                                "record": name,
                                "expr": f'label_replace(vector({value!r}), "instance", "{instance}", "", "")',
                            }
                            for name, value in ((mn.CAPACITY, capacity), (mn.CLIENT_DEADLINE, deadline_s))
                        ],
                    }
                ]
            }
        ),
        encoding="utf-8",
    )
    config = workdir / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {SCRAPE_INTERVAL_S:g}s, evaluation_interval: {SCRAPE_INTERVAL_S:g}s}}\n"
        f"rule_files: ['{rules}', '{stated}']\n"
        "scrape_configs:\n"
        f"  - job_name: {PROMETHEUS_JOBS['vllm']}\n"
        f"    static_configs: [{{targets: ['{instance}']}}]\n"
        f"{VLLM_NAMES_BACK}"
        f"  - job_name: {PROMETHEUS_JOBS['proxy']}\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n",
        encoding="utf-8",
    )
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--query.lookback-delta={lookback_delta(time_scale)}",
    ]
    with ManagedProcess(argv, log_path=workdir / "prometheus.log", bound_s=None, name="Prometheus") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(url + "/-/ready", timeout_s=30, poll_s=0.2)
        yield Prometheus(url, instance)
