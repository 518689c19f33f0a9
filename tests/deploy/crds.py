"""JSON Schemas for the custom resources the manifests use, which kubernetes-validate does not know.

Each is the subset of its CRD's OpenAPI schema that a retrywatch manifest may use, with
``additionalProperties: false`` at every level, so a misspelt or misplaced field fails the test
instead of being dropped by the API server. The field names, types, enums and patterns follow the
CRDs: prometheus-operator 0.84 (monitoring.coreos.com/v1), Gateway API v1 (standard channel) and
Envoy Gateway's gateway.envoyproxy.io/v1alpha1 (1.x). A field a manifest newly needs is added here
after checking it in the CRD.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _object(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_STRING: Schema = {"type": "string"}
_LABELS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
# prometheus-operator's Duration pattern (interval, scrapeTimeout).
_PROM_DURATION: Schema = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
# Gateway API's Duration (GEP-2257).
_GW_DURATION: Schema = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_METADATA: Schema = _object(
    {"name": _STRING, "namespace": _STRING, "labels": _LABELS, "annotations": _LABELS}, ("name",)
)
_LABEL_SELECTOR: Schema = _object(
    {
        "matchLabels": _LABELS,
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {"key": _STRING, "operator": _STRING, "values": {"type": "array", "items": _STRING}},
                ("key", "operator"),
            ),
        },
    }
)


def _resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return _object(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA, "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )


_RELABEL_ACTIONS = [
    *("Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep"),
    *("Lowercase", "Uppercase", "KeepEqual", "DropEqual"),
]
_RELABEL: Schema = _object(
    {
        "action": {"enum": [*_RELABEL_ACTIONS, *(a.lower() for a in _RELABEL_ACTIONS)]},
        "sourceLabels": {
            "type": "array",
            "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"},
        },
        "separator": _STRING,
        "targetLabel": _STRING,
        "regex": _STRING,
        "modulus": {"type": "integer"},
        "replacement": _STRING,
    }
)

SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _object(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _object({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
            "jobLabel": _STRING,
            "targetLabels": {"type": "array", "items": _STRING},
            "podTargetLabels": {"type": "array", "items": _STRING},
            "sampleLimit": {"type": "integer", "minimum": 0},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "port": _STRING,
                        "targetPort": {"type": ["integer", "string"]},
                        "path": _STRING,
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": _PROM_DURATION,
                        "scrapeTimeout": _PROM_DURATION,
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                    }
                ),
            },
        },
        ("selector", "endpoints"),
    ),
)

_RULE: Schema = _object(
    {
        "record": _STRING,
        "alert": _STRING,
        "expr": {"type": ["string", "integer"]},
        "for": _PROM_DURATION,
        "keep_firing_for": {"type": "string", "minLength": 1},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    ("expr",),
)
PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _object(
        {
            "groups": {
                "type": "array",
                "items": _object(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _PROM_DURATION,
                        "query_offset": _PROM_DURATION,
                        "limit": {"type": "integer"},
                        "partial_response_strategy": _STRING,
                        "labels": _LABELS,
                        "rules": {"type": "array", "items": _RULE},
                    },
                    ("name",),
                ),
            }
        }
    ),
)

_PARENT_REF: Schema = _object(
    {
        "group": _STRING,
        "kind": _STRING,
        "namespace": _STRING,
        "name": {"type": "string", "minLength": 1},
        "sectionName": _STRING,
        "port": {"type": "integer"},
    },
    ("name",),
)
GATEWAY = _resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _object(
        {
            "gatewayClassName": {"type": "string", "minLength": 1},
            "listeners": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "name": _STRING,
                        "hostname": _STRING,
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "protocol": _STRING,
                        "tls": {"type": "object"},
                        "allowedRoutes": {"type": "object"},
                    },
                    ("name", "port", "protocol"),
                ),
            },
        },
        ("gatewayClassName", "listeners"),
    ),
)
HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        {
            "parentRefs": {"type": "array", "items": _PARENT_REF},
            "hostnames": {"type": "array", "items": _STRING},
            "rules": {
                "type": "array",
                "items": _object(
                    {
                        "name": _STRING,
                        "matches": {
                            "type": "array",
                            "items": _object(
                                {
                                    "path": _object(
                                        {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": _STRING,
                                        }
                                    ),
                                    "headers": {"type": "array"},
                                    "queryParams": {"type": "array"},
                                    "method": _STRING,
                                }
                            ),
                        },
                        "backendRefs": {
                            "type": "array",
                            "items": _object(
                                {
                                    "group": _STRING,
                                    "kind": _STRING,
                                    "name": _STRING,
                                    "namespace": _STRING,
                                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                    "weight": {"type": "integer", "minimum": 0},
                                    "filters": {"type": "array"},
                                },
                                ("name",),
                            ),
                        },
                        "filters": {"type": "array"},
                        "timeouts": _object({"request": _GW_DURATION, "backendRequest": _GW_DURATION}),
                    }
                ),
            },
        }
    ),
)
_EG_DURATION = _GW_DURATION  # Envoy Gateway uses Gateway API's Duration
BACKEND_TRAFFIC_POLICY = _resource(
    "gateway.envoyproxy.io/v1alpha1",
    "BackendTrafficPolicy",
    _object(
        {
            "targetRefs": {
                "type": "array",
                "items": _object(
                    {"group": _STRING, "kind": _STRING, "name": _STRING, "sectionName": _STRING},
                    ("group", "kind", "name"),
                ),
            },
            "loadBalancer": _object(
                {
                    "type": {"enum": ["ConsistentHash", "LeastRequest", "Random", "RoundRobin"]},
                    "consistentHash": _object(
                        {
                            "type": {"enum": ["SourceIP", "Header", "Cookie"]},
                            "header": _object({"name": _STRING}, ("name",)),
                            "tableSize": {"type": "integer", "minimum": 2, "maximum": 5000011},
                        },
                        ("type",),
                    ),
                },
                ("type",),
            ),
            "timeout": _object(
                {
                    "tcp": _object({"connectTimeout": _EG_DURATION}),
                    "http": _object(
                        {
                            "connectionIdleTimeout": _EG_DURATION,
                            "maxConnectionDuration": _EG_DURATION,
                            "requestTimeout": _EG_DURATION,
                        }
                    ),
                }
            ),
        },
        ("targetRefs",),
    ),
)

BY_KIND: dict[str, Schema] = {
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
    "Gateway": GATEWAY,
    "HTTPRoute": HTTP_ROUTE,
    "BackendTrafficPolicy": BACKEND_TRAFFIC_POLICY,
}
