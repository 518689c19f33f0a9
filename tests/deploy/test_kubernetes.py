"""deploy/kubernetes rendered offline with ``kubectl kustomize``: the core objects validated with
kubernetes-validate, the custom resources against their CRDs' fields, and what ties them to the
rest of retrywatch (the rules' job, the proxy's options and call-id header, the clients' deadline)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from dashboard import grafana
from detector.signals import PROMETHEUS_JOBS
from exporter.callkey import DEFAULT_CALL_ID_HEADER
from rules.generate import RULES_PATH
from tests.deploy import crds
from tests.deploy.conftest import REPO, args_map, container, find

CRD_KINDS = set(crds.BY_KIND)
RETRYWATCH_IMAGE = "retrywatch"


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"
    }


def _engine(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment", "retrywatch-engine")


def _proxy_args(objects: list[dict[str, Any]]) -> dict[str, str]:
    return args_map(container(_engine(objects), "proxy")["args"])


def _deadline_s(objects: list[dict[str, Any]]) -> float:
    return float(_proxy_args(objects)["--deadline"])


def _rules_job() -> str:
    """The proxies' job, which the proxy tier's rules read (the vLLM tier's read vLLM's own)."""
    jobs = set(re.findall(r'up\{job="([^"]+)"\}', RULES_PATH.read_text(encoding="utf-8")))
    assert jobs == set(PROMETHEUS_JOBS.values()), jobs
    return PROMETHEUS_JOBS["proxy"]


def test_each_overlay_renders_the_fleet(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, objects in rendered.items():
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
        for expected in [
            ("Namespace", "retrywatch"),
            ("Deployment", "retrywatch-engine"),
            ("Service", "retrywatch-engine"),
            ("PodDisruptionBudget", "retrywatch-engine"),
            ("Deployment", "retrywatch-detector"),
            ("Service", "retrywatch-detector"),
            ("Deployment", "retrywatch-dashboard"),
            ("Service", "retrywatch-dashboard"),
            ("ServiceMonitor", "retrywatch"),
            ("PrometheusRule", "retrywatch"),
            ("ConfigMap", "retrywatch-grafana-dashboard"),
        ]:
            assert expected in kinds, f"{name} lacks {expected}"
        assert all(
            o["metadata"].get("namespace") == "retrywatch" for o in objects if o["kind"] != "Namespace"
        ), name
    assert ("Ingress", "retrywatch") in {
        (o["kind"], o["metadata"]["name"]) for o in rendered["ingress-nginx"]
    }
    gateway = {o["kind"] for o in rendered["gateway-api"]}
    assert {"Gateway", "HTTPRoute", "BackendTrafficPolicy"} <= gateway and "Ingress" not in gateway


def _kubernetes_validate(objects: list[dict[str, Any]], path: Path) -> subprocess.CompletedProcess[str]:
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False), encoding="utf-8")
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubernetes-validate"
    )
    assert exe is not None, "kubernetes-validate is in the project's test extra: pip install -e '.[test]'"
    return subprocess.run(
        [exe, "--strict", "-k", "1.32", str(path)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("overlay", ["ingress-nginx", "gateway-api", "postgresql"])
def test_core_objects_pass_kubernetes_validate_strict(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path
) -> None:
    objects = rendered[overlay]
    proc = _kubernetes_validate(objects, tmp_path / f"{overlay}.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # Only the custom resources may lack a schema: a core kind with a misspelt apiVersion would
    # otherwise pass as "unknown" too.
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", out))
    assert unknown == {o["kind"] for o in objects} & CRD_KINDS, out
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    assert out.count(" passed for resource ") == len(core), out


def test_kubernetes_validate_refuses_a_misspelt_field(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = json.loads(json.dumps(rendered["ingress-nginx"]))
    proxy = container(_engine(objects), "proxy")
    proxy["readinesProbe"] = proxy.pop("readinessProbe")
    proc = _kubernetes_validate(objects, tmp_path / "bad.yaml")
    assert proc.returncode != 0
    assert "'readinesProbe' was unexpected" in proc.stdout + proc.stderr


@pytest.mark.parametrize("overlay", ["ingress-nginx", "gateway-api"])
def test_custom_resources_have_their_crds_fields(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    custom = [o for o in rendered[overlay] if o["kind"] in CRD_KINDS]
    assert {o["kind"] for o in custom} >= {"ServiceMonitor", "PrometheusRule"}
    for obj in custom:
        jsonschema.validate(obj, crds.BY_KIND[obj["kind"]])


def test_the_crd_check_refuses_a_misplaced_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    monitor = json.loads(json.dumps(find(rendered["ingress-nginx"], "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["relabeling"] = monitor["spec"]["endpoints"][0].pop("relabelings")
    with pytest.raises(jsonschema.ValidationError, match="relabeling"):
        jsonschema.validate(monitor, crds.SERVICE_MONITOR)
    policy = json.loads(json.dumps(find(rendered["gateway-api"], "BackendTrafficPolicy")))
    policy["spec"]["loadBalancer"]["consistentHash"]["type"] = "Headers"
    with pytest.raises(jsonschema.ValidationError, match="Headers"):
        jsonschema.validate(policy, crds.BACKEND_TRAFFIC_POLICY)


def test_prometheus_scrapes_every_proxy_as_the_job_the_rules_read(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["ingress-nginx"]
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service", "retrywatch-engine")
    pod_labels = _engine(objects)["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # Only the engine Service (one endpoint per proxy) is scraped, never the detector's or dashboard's.
    others = [s for s in objects if s["kind"] == "Service" and s is not service]
    assert others and all(not selector.items() <= s["metadata"]["labels"].items() for s in others)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"] == {"action": "replace", "targetLabel": "job", "replacement": _rules_job()}
    assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    # Scraped at the rules' evaluation interval; a scrape outlasts the proxy's wait for vLLM's /metrics.
    rules = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
    assert endpoint["interval"] == rules["groups"][0]["interval"]
    assert float(endpoint["scrapeTimeout"].rstrip("s")) > 2.0


def test_pods_meet_the_restricted_pod_security_standard(rendered: dict[str, list[dict[str, Any]]]) -> None:
    namespace = find(rendered["ingress-nginx"], "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for overlay, objects in rendered.items():
        pods = _pods(objects)
        assert set(pods) == {"retrywatch-engine", "retrywatch-detector", "retrywatch-dashboard"}
        for name, pod in pods.items():
            where = f"{overlay}/{name}"
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["runAsUser"] > 0, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert pod["automountServiceAccountToken"] is False, where
            # Service links would inject RETRYWATCH_*-like variables the CLI reads as options.
            assert pod["enableServiceLinks"] is False, where
            assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), where
            assert all("hostPath" not in v for v in pod.get("volumes", [])), where
            for c in pod["containers"]:
                ctx = c["securityContext"]
                assert ctx["allowPrivilegeEscalation"] is False, (where, c["name"])
                assert ctx["readOnlyRootFilesystem"] is True, (where, c["name"])
                assert ctx["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
                assert "privileged" not in ctx, (where, c["name"])
                assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (where, c["name"])
                assert "memory" in c["resources"]["limits"], (where, c["name"])
                assert "livenessProbe" in c, (where, c["name"])
                assert "readinessProbe" in c or "startupProbe" in c, (where, c["name"])


def test_the_engine_listens_on_loopback_and_the_proxy_beside_it_on_the_pod(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    engine = _engine(rendered["ingress-nginx"])
    vllm = args_map(container(engine, "vllm")["args"])
    proxy = container(engine, "proxy")
    args = args_map(proxy["args"])
    assert vllm["--host"] == "127.0.0.1"
    assert args["--upstream"] == f"http://127.0.0.1:{vllm['--port']}"
    # The proxy binds 127.0.0.1 by default: in a pod it must be told to listen on the pod.
    assert args["--host"] in {"0.0.0.0", "::"}
    (port,) = proxy["ports"]
    assert port["containerPort"] == int(args["--port"])
    assert "ports" not in container(engine, "vllm")  # nothing to reach from outside the pod
    # The pod is ready when the engine is: the proxy's /health is vLLM's, passed through.
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    # vLLM outlives the proxy's pre-stop pause and drain (25 s, docs/proxy.md), within the grace period.
    pod = engine["spec"]["template"]["spec"]
    proxy_stop = proxy["lifecycle"]["preStop"]["sleep"]["seconds"] + 25 + 2
    engine_stop = container(engine, "vllm")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert proxy_stop < engine_stop < pod["terminationGracePeriodSeconds"]


def test_the_balancers_hash_the_call_id_header_over_the_proxies(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    ingress = find(rendered["ingress-nginx"], "Ingress")
    annotations = ingress["metadata"]["annotations"]
    variable = "$http_" + DEFAULT_CALL_ID_HEADER.replace("-", "_")
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == variable
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    assert path["path"] == "/v1" and path["pathType"] == "Prefix"  # not /metrics, not /retrywatch/
    assert path["backend"]["service"] == {"name": "retrywatch-engine", "port": {"name": "http"}}

    gateway = rendered["gateway-api"]
    route = find(gateway, "HTTPRoute")
    policy = find(gateway, "BackendTrafficPolicy")
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    service = find(gateway, "Service", "retrywatch-engine")
    assert rule["backendRefs"] == [{"name": "retrywatch-engine", "port": service["spec"]["ports"][0]["port"]}]
    assert route["spec"]["parentRefs"] == [{"name": find(gateway, "Gateway")["metadata"]["name"]}]
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    balancer = policy["spec"]["loadBalancer"]
    assert balancer["type"] == "ConsistentHash"
    assert balancer["consistentHash"]["type"] == "Header"
    assert balancer["consistentHash"]["header"]["name"].lower() == DEFAULT_CALL_ID_HEADER


def test_the_balancers_wait_longer_than_the_clients_deadline(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    deadline = _deadline_s(rendered["ingress-nginx"])
    annotations = find(rendered["ingress-nginx"], "Ingress")["metadata"]["annotations"]
    assert float(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > deadline
    (rule,) = find(rendered["gateway-api"], "HTTPRoute")["spec"]["rules"]
    assert rule["timeouts"]["request"] == "0s"  # none: Envoy's default of 15 s would cut calls short


def test_the_postgresql_component_reads_the_url_from_a_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["postgresql"]
    deployment = find(objects, "Deployment", "retrywatch-detector")
    detector = container(deployment, "detector")
    # No volume to hand over: the new detector starts first and stands by until the old one stops.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    base = find(rendered["ingress-nginx"], "Deployment", "retrywatch-detector")["spec"]["strategy"]
    assert base == {"type": "Recreate"}  # SQLite on a ReadWriteOnce volume: one pod at a time
    env = {e["name"]: e for e in detector["env"]}
    assert env["RETRYWATCH_DB"] == {
        "name": "RETRYWATCH_DB",
        "valueFrom": {"secretKeyRef": {"name": "retrywatch-detector-db", "key": "url"}},
    }
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}
    assert [m["mountPath"] for m in detector["volumeMounts"]] == ["/tmp"]
    base = container(find(rendered["ingress-nginx"], "Deployment", "retrywatch-detector"), "detector")
    assert {e["name"]: e.get("value") for e in base["env"]}["RETRYWATCH_DB"].startswith("sqlite:////data/")


def test_every_retrywatch_container_runs_the_packaged_image(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    images = {
        c["name"]: c["image"] for pod in _pods(rendered["ingress-nginx"]).values() for c in pod["containers"]
    }
    assert images.pop("vllm").startswith("vllm/vllm-openai:")
    assert set(images.values()) == {f"{RETRYWATCH_IMAGE}:{version}"}


def test_every_retrywatch_containers_arguments_are_options_of_its_command(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Each container's arguments parsed by the real command line: ``--help`` stops it before it
    runs, after an unknown option has already failed."""
    seen = set()
    for pod in _pods(rendered["ingress-nginx"]).values():
        for c in pod["containers"]:
            if not c["image"].startswith(RETRYWATCH_IMAGE + ":") or tuple(c["args"]) in seen:
                continue
            seen.add(tuple(c["args"]))
            proc = subprocess.run(
                [sys.executable, "-m", "retrywatch", *c["args"], "--help"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert proc.returncode == 0, (c["args"], proc.stderr)
    assert {args[0] for args in seen} == {"proxy", "detect", "dashboard"}


def test_the_grafana_dashboard_configmap_carries_the_generated_dashboard(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    config = find(rendered["ingress-nginx"], "ConfigMap", "retrywatch-grafana-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config["data"].values()
    dashboard = json.loads(text)
    assert dashboard == json.loads(grafana.render())  # the generated dashboard, as committed
