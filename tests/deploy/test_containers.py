"""Each retrywatch container of the engine, detector and dashboard Deployments, run as a real
process on loopback with its manifest's arguments and environment (only the addresses changed):
it starts, and answers the probes its manifest gives the kubelet."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.conftest import args_map, container, find


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _localize(args: list[str], port: int, urls: dict[str, str]) -> list[str]:
    """The arguments with the pod's addresses replaced by loopback ones; nothing else changed."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        assert eq or not name.startswith("--"), f"write options as --name=value in the manifests: {arg}"
        if name == "--host":
            value = "127.0.0.1"
        elif name == "--port":
            value = str(port)
        elif name in urls:
            value = urls[name]
        out.append(f"{name}={value}" if eq else arg)
    return out


def _env(c: dict[str, Any], data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    for var in c.get("env", []):
        if "value" in var:  # secrets are optional or replaced by a component: left out here
            env[var["name"]] = var["value"].replace("////data/", f"///{data_dir}/")
    return env


def _probe(probe: dict[str, Any], c: dict[str, Any], port: int) -> None:
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if "httpGet" in probe:
        target = probe["httpGet"]["port"]
        assert target in ports, probe
        response = httpx.get(
            f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=probe["timeoutSeconds"]
        )
        assert 200 <= response.status_code < 400, (probe, response.status_code)
    else:
        assert probe["tcpSocket"]["port"] in ports
        socket.create_connection(("127.0.0.1", port), timeout=probe["timeoutSeconds"]).close()


@contextlib.contextmanager
def _run(c: dict[str, Any], urls: dict[str, str], tmp_path: Path) -> Iterator[int]:
    port = _free_port()
    args = _localize(c["args"], port, urls)
    log = tmp_path / f"{args[0]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "retrywatch", *args],
            env=_env(c, tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        probe = c["readinessProbe"]
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                _probe(probe, c, port)
                break
            except (AssertionError, OSError, httpx.HTTPError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        _probe(c["livenessProbe"], c, port)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    with open(tmp_path / "upstream.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.exporter.upstream", "--port", str(port)], stdout=log, stderr=log
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_containers_start_with_their_manifests_arguments_and_answer_their_probes(
    rendered: dict[str, list[dict[str, Any]]], upstream: str, tmp_path: Path
) -> None:
    objects = rendered["ingress-nginx"]
    proxy = container(find(objects, "Deployment", "retrywatch-engine"), "proxy")
    detector = container(find(objects, "Deployment", "retrywatch-detector"), "detector")
    dashboard = container(find(objects, "Deployment", "retrywatch-dashboard"), "dashboard")
    nothing = f"http://127.0.0.1:{_free_port()}"  # Prometheus: unreachable here, and that is fine
    assert args_map(proxy["args"])["--upstream"].startswith("http://127.0.0.1:")
    with _run(proxy, {"--upstream": upstream}, tmp_path) as port:
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "retrywatch_attempts_total" in metrics and "vllm:" in metrics  # the engine's families too
    with _run(detector, {"--prometheus": nothing}, tmp_path) as port:
        assert (tmp_path / "retrywatch-detector.db").exists()  # its history on the volume
        with _run(dashboard, {"--detector": f"http://127.0.0.1:{port}", "--prometheus": nothing}, tmp_path):
            pass
