"""``retrywatch proxy`` as a subprocess, configured by flags and ``RETRYWATCH_*`` variables."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from exporter.cli import proxy
from exporter.settings import ProxySettings, SettingsError
from foundation.processes import ManagedProcess, free_port
from tests.exporter.support import ROOT, ProxyProcess, Upstream, env_without_retrywatch, proxy_process


def test_the_proxy_runs_as_a_subprocess_configured_by_environment(upstream: Upstream, tmp_path: Path) -> None:
    port = free_port()
    env = env_without_retrywatch() | {
        "RETRYWATCH_UPSTREAM": upstream.url,
        "RETRYWATCH_PORT": str(port),
        "RETRYWATCH_CAPACITY": "2.78",
        "RETRYWATCH_DEADLINE": "120",
        "RETRYWATCH_NO_SUCH_OPTION": "ignored",
    }
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--cancellation", "off", "--drain-timeout", "1"]
    proc = ManagedProcess(cmd, log_path=tmp_path / "proxy.log", bound_s=None, env=env, name="proxy")
    with proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/metrics", timeout_s=20, poll_s=0.05)
        body = {"model": "test-model", "prompt": [1, 2], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1"
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert "retrywatch_capacity_calls_per_second 2.78" in text
        assert "retrywatch_client_deadline_seconds 120.0" in text
        assert "retrywatch_executions_created_total 1.0" in text
        # SIGTERM with a stream open: the proxy exits (status 0) once its drain bound is over and
        # the upstream request is closed (the engine would abort it).
        call = uuid.uuid4().hex
        headers = {"x-call-id": call, "x-test-ttft": "60"}
        t = threading.Thread(target=_post_quietly, args=(f"{url}/v1/completions", body, headers))
        t.start()
        wait_for_request(upstream, call)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - began < 20
        t.join()
        wait_for_request(upstream, call, aborted=True)


def _post_quietly(url: str, body: dict[str, object], headers: dict[str, str]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, headers=headers, timeout=60)


def wait_for_request(upstream: Upstream, call: str, aborted: bool = False) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = upstream.requests(call_id=call)
        if rows and (not aborted or rows[0]["aborted"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the upstream never saw the request{' aborted' if aborted else ''}")


def test_bad_settings_are_usage_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--deadline-check"])
    assert result.exit_code == 2 and "--deadline" in result.output
    result = runner.invoke(proxy, ["--upstream", "not a url"])
    assert result.exit_code == 2 and "--upstream" in result.output
    result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--deadline", "soon"])
    assert result.exit_code == 2
    result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--cancellation", "maybe"])
    assert result.exit_code == 2
    result = runner.invoke(
        proxy, [], env={"RETRYWATCH_UPSTREAM": "http://127.0.0.1:1", "RETRYWATCH_PORT": "x"}
    )
    assert result.exit_code == 2  # the port variable is not a number


def test_the_metrics_passthrough_bounds_are_options_and_variables() -> None:
    runner = CliRunner()
    result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--metrics-timeout", "0"])
    assert result.exit_code == 2 and "--metrics-timeout" in result.output
    env = {"RETRYWATCH_UPSTREAM": "http://127.0.0.1:1", "RETRYWATCH_METRICS_MAX_STALENESS": "-1"}
    result = runner.invoke(proxy, [], env=env)
    assert result.exit_code == 2 and "--metrics-max-staleness" in result.output
    help_text = runner.invoke(proxy, ["--help"]).output
    assert "RETRYWATCH_METRICS_TIMEOUT" in help_text and "RETRYWATCH_METRICS_MAX_STALENESS" in help_text


def test_the_answer_buffer_is_an_option_that_must_hold_an_answer_of_the_largest_size() -> None:
    runner = CliRunner()
    base = ["--upstream", "http://127.0.0.1:1", "--max-answer-bytes", "4096"]
    result = runner.invoke(proxy, [*base, "--answer-buffer-bytes", "2048"])
    assert result.exit_code == 2 and "--answer-buffer-bytes" in result.output
    assert "RETRYWATCH_ANSWER_BUFFER_BYTES" in runner.invoke(proxy, ["--help"]).output


def test_the_server_bounds_and_routes_are_options_and_variables() -> None:
    runner = CliRunner()
    base = ["--upstream", "http://127.0.0.1:1"]
    for args, flag in [
        (["--head-timeout", "0"], "--head-timeout"),
        (["--body-timeout", "-1"], "--body-timeout"),
        (["--keep-alive-timeout", "0"], "--keep-alive-timeout"),
        (["--max-head-bytes", "10"], "--max-head-bytes"),
        (["--max-headers", "2"], "--max-headers"),
        (["--max-connections", "0"], "--max-connections"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--passthrough", "sleep"], "--passthrough"),
        (["--passthrough", "/v1/*/x"], "--passthrough"),
        (["--passthrough", "none", "--passthrough", "/health"], "--passthrough"),
    ]:
        result = runner.invoke(proxy, base + args)
        assert result.exit_code == 2 and flag in result.output, (args, result.output)
    env = {"RETRYWATCH_UPSTREAM": "http://127.0.0.1:1", "RETRYWATCH_PASSTHROUGH": "default /v1/../x"}
    result = runner.invoke(proxy, [], env=env)
    assert result.exit_code == 2 and "--passthrough" in result.output
    help_text = runner.invoke(proxy, ["--help"]).output
    for variable in (
        "RETRYWATCH_MAX_HEAD_BYTES",
        "RETRYWATCH_MAX_HEADERS",
        "RETRYWATCH_HEAD_TIMEOUT",
        "RETRYWATCH_BODY_TIMEOUT",
        "RETRYWATCH_KEEP_ALIVE_TIMEOUT",
        "RETRYWATCH_MAX_CONNECTIONS",
        "RETRYWATCH_DRAIN_TIMEOUT",
        "RETRYWATCH_PASSTHROUGH",
    ):
        assert variable in help_text


def _peer_ports(p: ProxyProcess, upstream: Upstream, gap_s: float) -> tuple[list[int], list[int]]:
    """Two generation requests and two passed-through ones, ``gap_s`` apart: the ports their
    upstream connections came from (the same port twice: the connection was reused)."""
    generation: list[int] = []
    passed: list[int] = []
    for i in range(2):
        if i:
            time.sleep(gap_s)
        call = uuid.uuid4().hex
        body = {"model": "test-model", "prompt": [1, 2], "max_tokens": 2}
        r = httpx.post(f"{p.url}/v1/completions", json=body, headers={"x-call-id": call}, timeout=10)
        assert r.status_code == 200
        generation.append(upstream.requests(call_id=call)[0]["peer_port"])
        r = httpx.get(f"{p.url}/test/peer", timeout=10)
        assert r.status_code == 200
        passed.append(r.json()["port"])
    return generation, passed


def test_the_upstream_idle_limit_is_an_option_and_a_variable(upstream: Upstream) -> None:
    runner = CliRunner()
    for value in ("0", "-1", "soon"):
        result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--upstream-max-idle", value])
        assert result.exit_code == 2 and "--upstream-max-idle" in result.output
    assert "RETRYWATCH_UPSTREAM_MAX_IDLE" in runner.invoke(proxy, ["--help"]).output
    peer = ("--passthrough", "default", "--passthrough", "/test/peer")
    # Idle 1.2 s: under the default (2 s) the generation client reuses its connection; under a
    # limit of 0.3 s (set by the variable) it does not. A route passed through never reuses one
    # (``exporter.upstream.UpstreamClient``: httpx would take bytes an upstream sent past the end
    # of an answer for the next request's answer).
    with proxy_process(upstream.url, *peer) as p:
        generation, passed = _peer_ports(p, upstream, 1.2)
        assert generation[0] == generation[1] and passed[0] != passed[1]
    env = {"RETRYWATCH_UPSTREAM_MAX_IDLE": "0.3"}
    with proxy_process(upstream.url, *peer, env=env) as p:
        generation, passed = _peer_ports(p, upstream, 1.2)
        assert generation[0] != generation[1] and passed[0] != passed[1]


def _upstream_on(port: int, log: Path) -> ManagedProcess:
    cmd = [sys.executable, "-m", "tests.exporter.upstream", "--port", str(port)]
    proc = ManagedProcess(cmd, log_path=log, bound_s=None, cwd=ROOT, name="test upstream").start()
    proc.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=20, poll_s=0.05)
    return proc


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def _json_lines(log: Path) -> list[dict[str, str]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert set(line) == {"time", "level", "logger", "message"}, line
    return lines


def test_the_proxy_says_once_where_it_serves_and_once_per_change_that_its_upstream_is_down_or_up(
    tmp_path: Path,
) -> None:
    upstream_port = free_port()
    upstream = _upstream_on(upstream_port, tmp_path / "upstream1.log")
    log = tmp_path / "proxy.log"
    try:
        with proxy_process(
            f"http://ops:S3CRET@127.0.0.1:{upstream_port}", "--log-format", "json", log=log
        ) as p:
            upstream.stop()
            wait_for(lambda: "is down" in log.read_text(), 20, "the upstream's down line")
            time.sleep(3.5)  # the proxy probes its upstream every second: several more failures
            upstream = _upstream_on(upstream_port, tmp_path / "upstream2.log")
            wait_for(lambda: "is back up" in log.read_text(), 20, "the upstream's up line")
            time.sleep(2.5)
            assert httpx.get(f"{p.url}/metrics", timeout=5).status_code == 200
    finally:
        upstream.stop()
    lines = _json_lines(log)
    start = lines[0]
    assert start["message"].startswith(f"retrywatch proxy on http://127.0.0.1:{p.port} ")
    assert f"in front of http://ops:***@127.0.0.1:{upstream_port}" in start["message"]
    assert sum("retrywatch proxy on" in line["message"] for line in lines) == 1
    changes = [line for line in lines if line["logger"] == "retrywatch.proxy"]
    assert [c["message"] for c in changes] == [
        f"upstream http://ops:***@127.0.0.1:{upstream_port} is down: no answer from it",
        f"upstream http://ops:***@127.0.0.1:{upstream_port} is back up",
    ], changes
    assert all(c["level"] == "warning" for c in changes)
    assert "S3CRET" not in log.read_text()
    assert not [line for line in lines if line["logger"].startswith("uvicorn")]  # quiet by default


def test_a_taken_port_is_one_line_naming_the_option_before_anything_is_announced(upstream: Upstream) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "retrywatch", "proxy", "--upstream", upstream.url, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env_without_retrywatch(),
        )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): pick another with --port"
    ]


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_an_openai_base_url_as_upstream_is_refused_at_start_saying_to_drop_v1(
    upstream: Upstream, suffix: str
) -> None:
    """The OpenAI SDKs' base-URL habit (http://HOST:PORT/v1) made every call through the proxy
    answer 404, since each request's own /v1/... path was appended to it."""
    port = free_port()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrywatch",
            "proxy",
            "--upstream",
            upstream.url + suffix,
            "--port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without_retrywatch(),
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --upstream is the engine's address without /v1 (the proxy forwards each request's own "
        f"/v1/... path): give {upstream.url}, not {upstream.url}{suffix}"
    )
    with socket.socket() as probe:  # nothing was started
        assert probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("suffix", ["/v1?api-version=1", "/v1/#models"])
def test_an_openai_base_url_with_a_query_or_fragment_is_refused_naming_the_bare_address(suffix: str) -> None:
    """The address to give is the server's: neither the API root nor what followed it."""
    with pytest.raises(SettingsError) as refused:
        ProxySettings(upstream="http://127.0.0.1:8000" + suffix)
    assert f"give http://127.0.0.1:8000, not http://127.0.0.1:8000{suffix}" in str(refused.value)


def test_every_command_has_the_same_log_options() -> None:
    from retrywatch.cli import SUBCOMMANDS, main

    for name in ("proxy", "detect", "dashboard", "emulate", "demo"):
        assert name in SUBCOMMANDS
        out = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        assert "--log-level [critical|error|warning|info|debug]" in out, name
        assert "[env var: RETRYWATCH_LOG_LEVEL; default: warning]" in out, name
        assert "--log-format [text|json]" in out and "RETRYWATCH_LOG_FORMAT" in out, name


def test_an_empty_host_is_a_usage_error_in_every_command_that_serves() -> None:
    # It listened on every interface, and announced http://:PORT/.
    from foundation.bounds import EMPTY_HOST
    from retrywatch.cli import main

    commands = (
        ["proxy", "--upstream", "http://127.0.0.1:9"],
        ["detect", "--exporter", "http://127.0.0.1:9/m"],
        ["dashboard"],
        ["emulate"],
        ["demo", "--no-browser"],
        ["demo", "--fleet", "2"],
    )
    for command in commands:
        result = CliRunner().invoke(main, [*command, "--host", ""])
        assert result.exit_code == 2, (command, result.output)
        last = result.output.strip().splitlines()[-1]
        assert last in (f"Error: Invalid value for '--host': {EMPTY_HOST}", f"Error: --host: {EMPTY_HOST}"), (
            last
        )


def test_port_zero_is_refused_by_every_command_that_serves() -> None:
    # Any free port would be taken, and the start line would announce http://HOST:0.
    from retrywatch.cli import main

    for command in (
        ["proxy", "--upstream", "http://127.0.0.1:9"],
        ["detect", "--exporter", "http://x/m"],
        ["dashboard"],
    ):
        result = CliRunner().invoke(main, [*command, "--port", "0"])
        assert result.exit_code == 2 and "--port" in result.output, (command, result.output)


@pytest.mark.parametrize("token", ["pässwörd", "two words", "tab\there", "newline\n", ""])
def test_an_admin_token_that_is_not_visible_ascii_is_refused_at_start_up(token: str) -> None:
    """The admin token is compared with the ``Authorization`` header, read as Latin-1 and then
    encoded as UTF-8: a non-ASCII token could never match what a client sends (the UTF-8 bytes of
    ``Bearer pässwörd`` got a 401), and a space or a control character cannot travel in a header
    as it is. Such a token is refused at start-up, by the flag and by the variable, without
    echoing it."""
    with pytest.raises(SettingsError, match="--admin-token must be") as refused:
        ProxySettings(upstream="http://127.0.0.1:1", admin_token=token)
    if token:
        assert token not in str(refused.value)
    if token in ("", "newline\n"):
        return  # an empty variable is unset to click; a newline is awkward on a command line
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", "http://127.0.0.1:1"]
    cmd += ["--port", str(free_port())]
    for how in ("flag", "variable"):
        args = ["--admin-token", token] if how == "flag" else []
        env = env_without_retrywatch() | ({"RETRYWATCH_ADMIN_TOKEN": token} if how == "variable" else {})
        result = subprocess.run(
            cmd + args,
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
        )
        assert result.returncode == 2 and "--admin-token must be" in result.stderr, (how, result.stderr)
        assert token not in result.stdout + result.stderr


def test_a_visible_ascii_admin_token_is_taken() -> None:
    token = "Abc-._~+/=!#$%&'*^`|0123456789"
    assert ProxySettings(upstream="http://127.0.0.1:1", admin_token=token).admin_token == token


def test_an_ipv6_listener_announces_a_url_that_reaches_it(tmp_path: Path) -> None:
    """On an IPv6 address the start line said ``http://::1:PORT``, which no client parses."""
    port = free_port()
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", "http://127.0.0.1:9"]
    cmd += ["--host", "::1", "--port", str(port)]
    log = tmp_path / "proxy.log"
    with ManagedProcess(cmd, log_path=log, bound_s=None, env=env_without_retrywatch(), name="proxy") as proc:
        proc.wait_ready(f"http://[::1]:{port}/metrics", timeout_s=20, poll_s=0.05, ready=lambda s: s < 500)
    announced = log.read_text().split("retrywatch proxy on ", 1)[1].split(" ", 1)[0]
    assert announced == f"http://[::1]:{port}"
    assert httpx.URL(announced).host == "::1"
