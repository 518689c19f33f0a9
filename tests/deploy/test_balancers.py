"""The shipped load-balancer configurations: rendered for N proxies, checked by nginx and HAProxy
themselves, Envoy's against its protobuf schema, and nginx and HAProxy run in front of real
replicas (the streaming test upstream) to show that every attempt of a call reaches one replica,
that calls spread, and that losing a replica moves only its own calls."""

from __future__ import annotations

import collections
import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from google.protobuf import json_format

from exporter.callkey import DEFAULT_CALL_ID_HEADER, IDEMPOTENCY_KEY_HEADER, find_call_id
from tests.deploy.conftest import DEPLOY, KUSTOMIZE, args_map, container, find

NGINX_DIR = DEPLOY / "nginx"
HAPROXY_CFG = DEPLOY / "haproxy" / "retrywatch.cfg"
ENVOY_YAML = DEPLOY / "envoy" / "envoy.yaml"
PRODUCTION_STACK = DEPLOY / "production-stack" / "values.yaml"


def _proxy_help_default(option: str) -> float:
    """A default of ``retrywatch proxy``, as its --help prints it."""
    proc = subprocess.run(
        [sys.executable, "-m", "retrywatch", "proxy", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = " ".join(proc.stdout.split())
    match = re.search(re.escape(option) + r" .*?default: ([0-9.]+)", text)
    assert match is not None, f"no default for {option} in `retrywatch proxy --help`"
    return float(match[1])


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)?", value)
    assert match is not None, value
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[match[2]]


def _nginx_directive(text: str, name: str) -> str:
    (value,) = re.findall(rf"^\s*{name}\s+([^;]+);", text, flags=re.MULTILINE)
    return value.strip()


def _haproxy_setting(text: str, setting: str) -> str:
    (value,) = re.findall(rf"^\s*{setting}\s+(\S+)\s*$", text, flags=re.MULTILINE)
    return value


# --- the configurations, offline -------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["", "host", "a;b:1", "127.0.0.1:0", "127.0.0.1:65536", "h:80 backup", "[::1:80", "-x:1"]
)
def test_render_refuses_what_is_not_host_port(render: ModuleType, address: str, tmp_path: Path) -> None:
    with pytest.raises(render.RenderError, match="HOST:PORT"):
        render.render_nginx([address], "127.0.0.1:8080", tmp_path)
    with pytest.raises(render.RenderError, match="HOST:PORT"):
        render.render_haproxy(["127.0.0.1:8101"], address, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_render_refuses_an_empty_or_repeated_replica_list(render: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(render.RenderError, match="at least one"):
        render.render_haproxy([], "127.0.0.1:8080", tmp_path)
    with pytest.raises(render.RenderError, match="twice"):
        render.render_nginx(["10.0.0.1:8100", "10.0.0.1:8100"], "127.0.0.1:8080", tmp_path)


def test_render_changes_only_the_listen_address_and_the_replicas(render: ModuleType, tmp_path: Path) -> None:
    replicas = ["10.0.0.11:8100", "proxy-2.example:8100", "[fd00::3]:8100"]
    conf = render.render_nginx(replicas, "0.0.0.0:9000", tmp_path / "nginx")
    assert conf.read_text() == (NGINX_DIR / "nginx.conf").read_text()
    shipped = (NGINX_DIR / "retrywatch.conf").read_text()
    assert (tmp_path / "nginx" / "retrywatch.conf").read_text() == shipped.replace(
        "listen 127.0.0.1:8080;", "listen 0.0.0.0:9000;"
    )
    servers = re.findall(r"^server (\S+) (.*);$", (tmp_path / "nginx" / "replicas.conf").read_text(), re.M)
    options = re.findall(r"^server \S+ (.*);$", (NGINX_DIR / "replicas.conf").read_text(), re.M)
    assert servers == [(r, options[0]) for r in replicas]

    cfg = render.render_haproxy(replicas, "0.0.0.0:9000", tmp_path / "haproxy").read_text()
    lines = cfg.splitlines()
    shipped_lines = HAPROXY_CFG.read_text().splitlines()
    assert [s for s in lines if s.strip().startswith("server ")] == [
        f"    server proxy{i} {r} id {render.haproxy_server_id(r)}" for i, r in enumerate(replicas, 1)
    ]
    assert "    bind 0.0.0.0:9000" in lines
    rest = [s for s in lines if not s.strip().startswith(("server ", "bind "))]
    assert rest == [s for s in shipped_lines if not s.strip().startswith(("server ", "bind "))]


def test_the_shipped_files_are_what_render_gives_for_their_own_replicas(
    render: ModuleType, tmp_path: Path
) -> None:
    """The shipped configurations are usable as they are, and consistent with the renderer."""
    shipped = ["127.0.0.1:8101", "127.0.0.1:8102"]
    render.render_nginx(shipped, "127.0.0.1:8080", tmp_path / "n")
    for name in ("nginx.conf", "retrywatch.conf", "replicas.conf"):
        assert (tmp_path / "n" / name).read_text() == (NGINX_DIR / name).read_text(), name
    assert (
        render.render_haproxy(shipped, "127.0.0.1:8080", tmp_path / "h").read_text()
        == HAPROXY_CFG.read_text()
    )


def test_render_command_line(tmp_path: Path) -> None:
    cmd = [sys.executable, str(DEPLOY / "render.py"), "haproxy", "--replica", "127.0.0.1:8101"]
    ok = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "retrywatch.cfg")
    bad = subprocess.run(
        [*cmd, "--listen", "0.0.0.0", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "not a HOST:PORT address: '0.0.0.0'" in bad.stderr


@pytest.mark.balancer
def test_nginx_accepts_the_shipped_and_the_rendered_configuration(
    nginx: str, render: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "shipped").mkdir()  # the prefix: its pid and temporary files
    shipped = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path / "shipped"), "-e", "stderr", "-c", str(NGINX_DIR / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shipped.returncode == 0, shipped.stderr
    conf = render.render_nginx(
        [f"127.0.0.1:{p}" for p in (9101, 9102, 9103)], "127.0.0.1:9100", tmp_path / "n"
    )
    proc = subprocess.run(
        [nginx, "-t", "-p", str(conf.parent), "-e", "stderr", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "test is successful" in proc.stderr


@pytest.mark.balancer
def test_haproxy_accepts_the_shipped_and_the_rendered_configuration(
    haproxy: str, render: ModuleType, tmp_path: Path
) -> None:
    cfg = render.render_haproxy([f"127.0.0.1:{p}" for p in (9101, 9102, 9103)], "127.0.0.1:9100", tmp_path)
    for path in (HAPROXY_CFG, cfg):
        proc = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Configuration file is valid" in proc.stdout + proc.stderr
        assert "WARNING" not in proc.stdout + proc.stderr
    broken = tmp_path / "broken.cfg"
    broken.write_text(cfg.read_text().replace("hash-type consistent", "hash-type consistant"))
    proc = subprocess.run([haproxy, "-c", "-f", str(broken)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def _envoy_bootstrap() -> Any:
    # Envoy's own protobuf schema (xds-protos); each typed_config's type must be imported.
    import envoy.extensions.filters.http.router.v3.router_pb2
    import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2
    import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2  # noqa: F401
    from envoy.config.bootstrap.v3.bootstrap_pb2 import Bootstrap

    return json_format.ParseDict(yaml.safe_load(ENVOY_YAML.read_text(encoding="utf-8")), Bootstrap())


def test_the_envoy_configuration_parses_against_envoys_schema() -> None:
    """Envoy itself is not installable here (docs/fleet.md): its configuration is parsed against
    the v3 API's protobuf messages, which refuse any unknown field, also inside typed_config."""
    from envoy.config.cluster.v3.cluster_pb2 import Cluster
    from envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 import (
        HttpConnectionManager,
    )

    bootstrap = _envoy_bootstrap()
    (cluster,) = bootstrap.static_resources.clusters
    assert cluster.lb_policy in (Cluster.RING_HASH, Cluster.MAGLEV)
    # Bounded-load hashing would move calls off a busy replica: never configured.
    assert not cluster.HasField("common_lb_config") or not cluster.common_lb_config.HasField(
        "consistent_hashing_lb_config"
    )
    (listener,) = bootstrap.static_resources.listeners
    assert listener.address.socket_address.address == "127.0.0.1"
    hcm = HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    routes = hcm.route_config.virtual_hosts[0].routes
    forwarding = [r.route for r in routes if r.HasField("route")]
    assert forwarding and all(a.cluster == cluster.name for a in forwarding)
    # No route timeout (Envoy's default 15 s would cut calls), no retry policy (a second execution).
    assert all(a.timeout.ToSeconds() == 0 and not a.HasField("retry_policy") for a in forwarding)
    blocked = [r.match for r in routes if r.HasField("direct_response")]
    assert {m.path or m.safe_regex.regex for m in blocked} == {"/metrics", "/retrywatch(/|%2[Ff]).*"}
    # Matched on the normalized path, as the proxy routes the decoded one: without normalize_path
    # /%6Detrics would pass the /metrics route and reach the proxy's /metrics.
    assert hcm.normalize_path.value is True
    (regex,) = [m.safe_regex.regex for m in blocked if m.safe_regex.regex]
    for path in ("/retrywatch/executions", "/retrywatch%2Fexecutions", "/retrywatch%2fx"):
        assert re.fullmatch(regex, path), path  # Envoy's safe_regex must match the whole path
    assert not re.fullmatch(regex, "/v1/retrywatch/x")


def _envoy_hash_input(routes: Any, headers: dict[str, str]) -> tuple[str, str] | None:
    """The (header, value) Envoy hashes for a POST to /v1/completions with ``headers``, or None
    when it makes no hash (a host at random): the first route whose match holds, then its hash
    policies as Envoy's HeaderHashMethod evaluates them: a header that is present is hashed, even
    with an empty value; a terminal policy that made a hash ends the list."""
    for route in routes:
        match = route.match
        if match.path and match.path != "/v1/completions":
            continue
        if match.safe_regex.regex and not re.fullmatch(match.safe_regex.regex, "/v1/completions"):
            continue
        if match.prefix and not "/v1/completions".startswith(match.prefix):
            continue
        if not all(
            h.name in headers and re.fullmatch(h.string_match.safe_regex.regex, headers[h.name])
            for h in match.headers
        ):
            continue
        assert route.HasField("route"), route
        found: tuple[str, str] | None = None
        for policy in route.route.hash_policy:
            name = policy.header.header_name
            if name in headers and found is None:
                found = (name, headers[name])  # Envoy combines later hashes in: none is expected
            elif name in headers:
                pytest.fail(f"two headers hashed for {headers}")
            if policy.terminal and found is not None:
                break
        return found
    pytest.fail(f"no route for {headers}")


@pytest.mark.parametrize(
    "headers",
    [
        {DEFAULT_CALL_ID_HEADER: "call-1"},
        {DEFAULT_CALL_ID_HEADER: "call-1", IDEMPOTENCY_KEY_HEADER: "key-1"},
        {IDEMPOTENCY_KEY_HEADER: "key-1"},
        {DEFAULT_CALL_ID_HEADER: "", IDEMPOTENCY_KEY_HEADER: "key-1"},
        {DEFAULT_CALL_ID_HEADER: ""},
        {IDEMPOTENCY_KEY_HEADER: ""},
        {},
    ],
)
def test_envoy_hashes_the_call_id_as_the_proxy_reads_it(headers: dict[str, str]) -> None:
    """Envoy hashes what the proxy takes as the call id (exporter/callkey.py: X-Call-Id, else
    Idempotency-Key, an empty value counting as absent), and makes no hash without one: hashing
    an empty X-Call-Id would send every such call to one host and ignore its Idempotency-Key."""
    from envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 import (
        HttpConnectionManager,
    )

    hcm = HttpConnectionManager()
    _envoy_bootstrap().static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    routes = hcm.route_config.virtual_hosts[0].routes
    call_id = find_call_id(headers)
    expected = None if call_id is None else next((h, v) for h, v in headers.items() if v == call_id)
    assert _envoy_hash_input(routes, headers) == expected


def test_a_misspelt_envoy_field_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "envoy.yaml"
    bad.write_text(ENVOY_YAML.read_text().replace("header_name: x-call-id", "headername: x-call-id"))
    monkeypatch.setattr(sys.modules[__name__], "ENVOY_YAML", bad)
    with pytest.raises(json_format.ParseError, match="headername"):
        _envoy_bootstrap()


def test_every_balancer_hashes_the_call_id_as_the_proxy_reads_it() -> None:
    nginx = (NGINX_DIR / "retrywatch.conf").read_text()
    assert _nginx_directive(nginx, "hash") == "$retrywatch_call_id consistent"
    # X-Call-Id, else Idempotency-Key: the proxy's own order (exporter/callkey.py).
    header = DEFAULT_CALL_ID_HEADER.replace("-", "_")
    idem = IDEMPOTENCY_KEY_HEADER.replace("-", "_")
    assert re.search(
        rf"map \$http_{header} \$retrywatch_call_id \{{\s*\"\"\s+\$http_{idem};\s*default\s+\$http_{header};",
        nginx,
    )
    haproxy = HAPROXY_CFG.read_text()
    (balance,) = re.findall(r"^\s*balance (\S+)", haproxy, flags=re.M)
    assert balance.lower() == f"hdr({DEFAULT_CALL_ID_HEADER})"
    assert _haproxy_setting(haproxy, "hash-type") == "consistent"
    assert "hash-balance-factor" not in re.sub(r"#.*", "", haproxy)
    values = yaml.safe_load(PRODUCTION_STACK.read_text())
    assert values["routerSpec"]["routingLogic"] == "session"
    assert values["routerSpec"]["sessionKey"] == DEFAULT_CALL_ID_HEADER


def test_the_balancers_outwait_the_clients_and_close_idle_connections_before_the_proxy(kubectl: str) -> None:
    """Read timeouts above the clients' deadline (a balancer that gives up first answers 504, and
    the client retries); idle upstream connections closed before the proxy's keep-alive timeout
    closes them under a request."""
    from tests.deploy.conftest import kustomize

    engine = find(kustomize(kubectl, KUSTOMIZE / "base"), "Deployment", "retrywatch-engine")
    deadline = float(args_map(container(engine, "proxy")["args"])["--deadline"])
    keep_alive = _proxy_help_default("--keep-alive-timeout")
    nginx = (NGINX_DIR / "retrywatch.conf").read_text()
    assert _seconds(_nginx_directive(nginx, "proxy_read_timeout")) > deadline
    assert _seconds(_nginx_directive(nginx, "keepalive_timeout")) < keep_alive
    assert _nginx_directive(nginx, "proxy_buffering") == "off"
    haproxy = HAPROXY_CFG.read_text()
    assert _seconds(_haproxy_setting(haproxy, "timeout server")) > deadline
    assert _seconds(_haproxy_setting(haproxy, "timeout http-keep-alive")) < keep_alive
    envoy = yaml.safe_load(ENVOY_YAML.read_text())
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert _seconds(hcm["stream_idle_timeout"]) > deadline
    options = envoy["static_resources"]["clusters"][0]["typed_extension_protocol_options"]
    (upstream,) = options.values()
    assert _seconds(upstream["common_http_protocol_options"]["idle_timeout"]) < keep_alive
    policy = yaml.safe_load_all((KUSTOMIZE / "gateway-api" / "gateway.yaml").read_text())
    btp = next(d for d in policy if d["kind"] == "BackendTrafficPolicy")
    assert _seconds(btp["spec"]["timeout"]["http"]["connectionIdleTimeout"]) < keep_alive


def test_the_production_stack_router_finds_the_proxies(kubectl: str) -> None:
    from tests.deploy.conftest import kustomize

    objects = kustomize(kubectl, KUSTOMIZE / "base")
    engine = find(objects, "Deployment", "retrywatch-engine")
    values = yaml.safe_load(PRODUCTION_STACK.read_text())
    assert values["servingEngineSpec"]["enableEngine"] is False
    extra = args_map(values["routerSpec"]["extraArgs"])
    assert extra["--k8s-port"] == args_map(container(engine, "proxy")["args"])["--port"]
    selector = dict(pair.split("=") for pair in extra["--k8s-label-selector"].split(","))
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    # Only the engine pods: the detector's and the dashboard's are not replicas.
    others = [d for d in objects if d["kind"] == "Deployment" and d is not engine]
    assert all(not selector.items() <= d["spec"]["template"]["metadata"]["labels"].items() for d in others)


# --- real routing ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class Replica:
    """One test upstream process standing in for a replica (its proxy and engine)."""

    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tags(self) -> set[str]:
        rows = httpx.get(f"http://{self.address}/test/requests", timeout=10).json()["requests"]
        return {r["tag"] for r in rows if r["tag"]}


@dataclass
class Fleet:
    replicas: list[Replica]
    url: str = ""
    seen: dict[str, str] = field(default_factory=dict)  # tag -> replica address

    def placement(self) -> dict[str, str]:
        """Where each tagged attempt landed (every one exactly once)."""
        where: dict[str, str] = {}
        for replica in self.replicas:
            if replica.proc.poll() is not None:
                continue
            for tag in replica.tags():
                assert tag not in where, f"{tag} reached two replicas"
                where[tag] = replica.address
        self.seen.update(where)
        return dict(self.seen)

    def attempt(self, client: httpx.Client, tag: str, headers: dict[str, str]) -> None:
        """One streamed attempt through the balancer, read to its end."""
        body = {"model": "test-model", "prompt": "hi", "max_tokens": 3, "stream": True}
        with client.stream(
            "POST", f"{self.url}/v1/completions", json=body, headers={"x-test-tag": tag, **headers}
        ) as response:
            assert response.status_code == 200, (tag, response.status_code)
            assert response.headers["content-type"].startswith("text/event-stream")
            text = "".join(response.iter_text())
        assert text.count("data: ") == 3 + 1 and text.rstrip().endswith("data: [DONE]"), (tag, text)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    replicas: list[Replica] = []
    try:
        for _ in range(3):
            port = _free_port()
            with open(tmp_path / f"upstream-{port}.log", "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.exporter.upstream", "--port", str(port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            replicas.append(Replica(port, proc))
        for replica in replicas:
            _wait_http(f"http://{replica.address}/health", replica.proc)
        yield Fleet(replicas)
    finally:
        for replica in replicas:
            _stop(replica.proc)


@contextlib.contextmanager
def _balancer(
    kind: str, fleet: Fleet, render: ModuleType, binary: str, tmp_path: Path, replicas: list[Replica]
) -> Iterator[str]:
    """nginx or HAProxy, rendered from the shipped configuration for ``replicas``, on a free port."""
    listen = f"127.0.0.1:{_free_port()}"
    addresses = [r.address for r in replicas]
    out = tmp_path / f"{kind}-{len(addresses)}"
    if kind == "nginx":
        conf = render.render_nginx(addresses, listen, out)
        cmd = [binary, "-p", str(conf.parent), "-e", "stderr", "-c", str(conf)]
    else:
        cmd = [binary, "-db", "-f", str(render.render_haproxy(addresses, listen, out))]
    with open(out / "log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://{listen}/health", proc)
        fleet.url = f"http://{listen}"
        yield fleet.url
    finally:
        _stop(proc)


@dataclass
class Balanced:
    fleet: Fleet
    kind: str
    start: Callable[[list[Replica]], contextlib.AbstractContextManager[str]]  # a balancer in front of them


@pytest.fixture(params=["nginx", "haproxy"])
def balanced(request: pytest.FixtureRequest, fleet: Fleet, render: ModuleType, tmp_path: Path) -> Balanced:
    kind = request.param
    binary = request.getfixturevalue(kind)
    return Balanced(fleet, kind, lambda replicas: _balancer(kind, fleet, render, binary, tmp_path, replicas))


def _by_call(placement: dict[str, str], prefix: str) -> dict[str, set[str]]:
    calls: dict[str, set[str]] = collections.defaultdict(set)
    for tag, address in placement.items():
        if tag.startswith(prefix):
            calls[tag.rsplit("-", 1)[0]].add(address)
    return calls


@pytest.mark.balancer
def test_all_attempts_of_a_call_reach_one_replica_and_calls_spread(balanced: Balanced) -> None:
    fleet = balanced.fleet
    addresses = {r.address for r in fleet.replicas}
    with balanced.start(fleet.replicas), httpx.Client(timeout=30) as client:
        for call in range(60):
            for attempt in range(3):
                fleet.attempt(client, f"id-{call}-{attempt}", {"X-Call-Id": f"call-{call}"})
        for call in range(20):  # the other header the proxy reads a call id from
            for attempt in range(2):
                fleet.attempt(client, f"idem-{call}-{attempt}", {"Idempotency-Key": f"key-{call}"})
        for n in range(30):  # no call id: no affinity
            fleet.attempt(client, f"none-{n}-0", {})
    placement = fleet.placement()
    assert len(placement) == 60 * 3 + 20 * 2 + 30
    by_id = _by_call(placement, "id-")
    assert len(by_id) == 60 and all(len(where) == 1 for where in by_id.values()), by_id
    assert set().union(*by_id.values()) == addresses  # 60 calls over 3 replicas: every one gets some
    by_key = _by_call(placement, "idem-")
    assert all(len(where) == 1 for where in by_key.values()), by_key
    assert len(set().union(*by_key.values())) > 1
    spread = collections.Counter(a for t, a in placement.items() if t.startswith("none-"))
    assert set(spread) == addresses, spread  # round-robin: 30 requests reach all three


@pytest.mark.balancer
def test_a_lost_replica_moves_only_its_own_calls(balanced: Balanced) -> None:
    """A replica dies (the balancer still lists it, then finds its connections refused), then leaves
    the balancer's list (as Kubernetes removes its endpoint): through both, the other replicas'
    calls stay where they are, and each of the lost replica's calls moves to one survivor."""
    fleet = balanced.fleet
    lost = fleet.replicas[1]  # in the middle of the list: removing it renumbers what follows
    survivors = [r for r in fleet.replicas if r is not lost]
    calls = range(45)
    with httpx.Client(timeout=30) as client:
        with balanced.start(fleet.replicas):
            for i in calls:
                fleet.attempt(client, f"c{i}-a0", {"X-Call-Id": f"call-{i}"})
            before = {tag.rsplit("-", 1)[0]: a for tag, a in fleet.placement().items()}
            assert lost.address in before.values()
            _stop(lost.proc)
            for i in calls:
                fleet.attempt(client, f"c{i}-a1", {"X-Call-Id": f"call-{i}"})
        with balanced.start(survivors):
            for i in calls:
                fleet.attempt(client, f"c{i}-a2", {"X-Call-Id": f"call-{i}"})
    placement = fleet.placement()
    for phase in ("a1", "a2"):
        after = {t.rsplit("-", 1)[0]: a for t, a in placement.items() if t.endswith(phase)}
        for call, first in before.items():
            if first == lost.address:
                assert after[call] != lost.address
            else:
                assert after[call] == first, f"{phase}: {call} moved from {first} to {after[call]}"
    moved = {
        c: {a for t, a in placement.items() if t.startswith(c + "-a") and not t.endswith("a0")}
        for c, first in before.items()
        if first == lost.address
    }
    assert moved and all(len(where) == 1 for where in moved.values()), moved


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[Replica]:
    """A real ``retrywatch proxy`` in front of a test upstream: a replica with the proxy's own routes."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream_port, proxy_port = _free_port(), _free_port()
        with open(tmp_path / "upstream.log", "wb") as log:
            upstream = subprocess.Popen(
                [sys.executable, "-m", "tests.exporter.upstream", "--port", str(upstream_port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(upstream)
        _wait_http(f"http://127.0.0.1:{upstream_port}/health", upstream)
        with open(tmp_path / "proxy.log", "wb") as log:
            options = ["--port", str(proxy_port), "--upstream", f"http://127.0.0.1:{upstream_port}"]
            proxy = subprocess.Popen(
                [sys.executable, "-m", "retrywatch", "proxy", *options],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proxy)
        _wait_http(f"http://127.0.0.1:{proxy_port}/health", proxy)
        yield Replica(proxy_port, proxy)
    finally:
        for proc in reversed(procs):
            _stop(proc)


# The proxy routes the decoded path: each of these is its /metrics or /retrywatch/executions.
_OWN_ROUTES_SPELT = (
    "/metrics",
    "/metrics?x=1",
    "/%6Detrics",
    "/%6detrics",
    "/retrywatch/executions",
    "/%72etrywatch/executions",
    "/retrywatch%2Fexecutions",
    "/retrywatch%2fexecutions",
)


@pytest.mark.balancer
@pytest.mark.parametrize("kind", ["nginx", "haproxy"])
def test_the_proxys_own_routes_stay_off_the_balancer_however_the_path_is_spelt(
    kind: str, proxied: Replica, render: ModuleType, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each proxy's /metrics and /retrywatch/ are kept off the public address: a balancer that
    matched the raw path let a percent-encoded spelling through to the proxy, which decodes it."""
    binary = request.getfixturevalue(kind)
    fleet = Fleet([proxied])
    with httpx.Client(timeout=10) as client:
        for path in _OWN_ROUTES_SPELT:  # each spelling is one of the proxy's own routes
            direct = client.get(f"http://{proxied.address}{path}")
            assert direct.status_code == 200, (path, direct.status_code)
        with _balancer(kind, fleet, render, binary, tmp_path, [proxied]) as url:
            assert client.get(f"{url}/v1/models").status_code == 200  # the API still passes
            leaked = {p: client.get(f"{url}{p}").status_code for p in _OWN_ROUTES_SPELT}
    assert leaked == dict.fromkeys(_OWN_ROUTES_SPELT, 404), leaked


@pytest.mark.balancer
def test_an_idempotency_key_with_commas_reaches_the_proxy_whole(balanced: Balanced) -> None:
    """HAProxy copies Idempotency-Key into X-Call-Id (nginx leaves both as they are): the whole
    value, or two calls whose keys end alike would reach the proxy as one call id."""
    fleet = balanced.fleet
    keys = ["k1,shared", "k2,shared"]
    with balanced.start(fleet.replicas), httpx.Client(timeout=30) as client:
        for n, key in enumerate(keys):
            fleet.attempt(client, f"comma-{n}", {IDEMPOTENCY_KEY_HEADER: key})
    rows = [
        r
        for replica in fleet.replicas
        for r in httpx.get(f"http://{replica.address}/test/requests?tag_prefix=comma-", timeout=10).json()[
            "requests"
        ]
    ]
    seen = {r["tag"]: r["call_id"] for r in rows}  # the X-Call-Id that reached the replica
    expected = keys if balanced.kind == "haproxy" else [None, None]
    assert seen == {f"comma-{n}": e for n, e in enumerate(expected)}, seen


@pytest.mark.balancer
def test_an_empty_call_id_falls_back_to_the_idempotency_key_as_the_proxy_does(balanced: Balanced) -> None:
    """The proxy takes an empty (or blank) X-Call-Id as absent and keys the call by its
    Idempotency-Key (exporter/callkey.py): the balancer must hash that key too, or each attempt
    of such a call is balanced on its own and its retries create executions on other replicas."""
    fleet = balanced.fleet
    with balanced.start(fleet.replicas), httpx.Client(timeout=30) as client:
        for call in range(20):
            for attempt in range(3):
                headers = {DEFAULT_CALL_ID_HEADER: "", IDEMPOTENCY_KEY_HEADER: f"key-{call}"}
                fleet.attempt(client, f"blank-{call}-{attempt}", headers)
    by_key = _by_call(fleet.placement(), "blank-")
    assert len(by_key) == 20 and all(len(where) == 1 for where in by_key.values()), by_key
    assert len(set().union(*by_key.values())) > 1  # the calls still spread
