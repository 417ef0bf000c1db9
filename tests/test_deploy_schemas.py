"""deploy/k8s/ against the API schemas a cluster checks them with: Kubernetes' own kinds with
kubernetes-validate (strict: unknown fields are errors, as `kubectl apply` rejects them), the CRDs
(PodMonitor, LeaderWorkerSet) with their published schemas vendored in deploy/k8s/schemas/, made
strict the same way; what a vendored schema leaves to a Kubernetes type (LeaderWorkerSet's pod
templates, every custom resource's metadata) is checked against that type. Each check is shown
to fail on a broken copy of a manifest."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
K8S_VERSION = "1.37"  # the newest release kubernetes-validate 1.37.0 carries
NOT_MANIFESTS = {"prometheus-adapter-values.yaml"}  # Helm values, checked in test_deploy_server_agreement
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-v1.json",
               ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-v1.json"}
VALIDATED_AS = "x-moe-serve-validated-as"  # marks a subtree the vendored schema left to a Kubernetes type
KIND_OF_TYPE = {"io.k8s.api.core.v1.PodTemplateSpec": "template"}  # checked as a v1 PodTemplate's field


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every manifest in deploy/k8s/."""
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name not in NOT_MANIFESTS:
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema as strict JSON Schema: objects with listed properties take no
    others (unless the CRD preserves unknown fields there), `nullable` allows null."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _marked(schema: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(property path, Kubernetes type) of every subtree marked VALIDATED_AS."""
    if VALIDATED_AS in schema:
        return [(path, schema[VALIDATED_AS])]
    found = []
    for name, sub in schema.get("properties", {}).items():
        found += _marked(sub, (*path, name))
    return found


def _at(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(doc, dict) or name not in doc:
            return None
        doc = doc[name]
    return doc


def validate(doc: dict[str, Any]) -> None:
    """Raise if `doc` is not what a cluster of K8S_VERSION with the vendored CRDs accepts."""
    crd = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd is None:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    schema = json.loads((DEPLOY / "schemas" / crd).read_text())["openAPIV3Schema"]
    jsonschema.Draft202012Validator(strict(schema)).validate(doc)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 K8S_VERSION, strict=True)  # metadata is an ObjectMeta
    for path, k8s_type in _marked(schema):
        value = _at(doc, path)
        if value is not None:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                                          KIND_OF_TYPE[k8s_type]: value}, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    validate(doc)


def test_every_shipped_kind_is_there() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "LeaderWorkerSet", "PodDisruptionBudget",
                     "PodMonitor", "Service", "Service"], kinds


def _one(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(doc for _, doc in manifests() if doc["kind"] == kind))


def _rejected(doc: dict[str, Any]) -> bool:
    try:
        validate(doc)
    except (jsonschema.ValidationError, kubernetes_validate.ValidationError):
        return True
    return False


def test_validation_rejects_broken_copies() -> None:
    """Every path of validate() fails on a mistake a cluster would refuse."""
    deployment = _one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}  # unknown field
    assert _rejected(deployment)
    monitor = _one("PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"  # not a duration
    assert _rejected(monitor)
    monitor = _one("PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["bearerToken"] = "x"  # unknown field (strict)
    assert _rejected(monitor)
    monitor = _one("PodMonitor")
    monitor["metadata"]["labels"] = {"app": 1}  # label values are strings
    assert _rejected(monitor)
    lws = _one("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    assert _rejected(lws)
    lws = _one("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resource"] = {}
    assert _rejected(lws)  # inside the pod template the CRD schema leaves to Kubernetes' type


def test_vendored_crd_schemas_say_where_they_come_from() -> None:
    for name in CRD_SCHEMAS.values():
        vendored = json.loads((DEPLOY / "schemas" / name).read_text())
        assert "github.com/" in vendored["$comment"] and "commit" in vendored["$comment"], name
        assert vendored["openAPIV3Schema"]["properties"]["spec"]["properties"], name
