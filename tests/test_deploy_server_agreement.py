"""deploy/k8s/ agrees with the server: every flag and MOE_SERVE_* variable the pods set is one the
server parses (moe_serve.service.cli's parser) and parses to what the manifests assume; ports, probe and
scrape paths, the Secret keys and the drain time line up; the probe paths answer without a key,
/metrics with the Secret's /metrics key, and the series the autoscaler reads exist, on the real
server (the strict_server fixture: an API key and a separate /metrics key, as in the manifests)."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest
import vllm.envs
import yaml

from moe_serve.loadtest.server_proc import ServerProcess
from moe_serve.service.cli import build_parser, settings_from_args
from moe_serve.service.settings import Settings
from moe_serve.service.shutdown import ABORT_FLUSH_S
from tests.conftest import STRICT_METRICS_KEY

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
ENGINE_STOP_S = 10  # least time the grace period leaves for stopping the engine after the drain
OTHER_ENV = {"TRITON_CACHE_DIR"}  # read by Triton, not the server
MOE_SERVE = "moe-serve"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _doc(name: str, kind: str) -> dict[str, Any]:
    return next(d for d in _docs(name) if d["kind"] == kind)


def _server_pods() -> dict[str, dict[str, Any]]:
    """Pod templates (metadata + spec) that run the server: the Deployment's, the LWS leader's."""
    lws = _doc("leaderworkerset-ray.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"deployment": _doc("deployment.yaml", "Deployment")["spec"]["template"],
            "lws-leader": lws["leaderTemplate"]}


def _container(pod: dict[str, Any], name: str = MOE_SERVE) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def _server_argv(container: dict[str, Any]) -> list[str]:
    """The server's own flags: `args` of the image's moe-serve entry point, or what follows
    `exec moe-serve` in a shell command."""
    if "command" not in container:
        return list(container.get("args", []))
    script = container["command"][-1]
    match = re.search(r"\bexec moe-serve\b(.*)$", script, re.S)
    assert match, f"the command does not exec moe-serve: {script!r}"
    return shlex.split(match.group(1))


def _settings(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What the server makes of the container's env and flags (Secret values stand in as 'secret:KEY')."""
    for name in [n for n in os.environ if n.startswith("MOE_SERVE_")]:
        monkeypatch.delenv(name)
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        monkeypatch.setenv(var["name"], f"secret:{ref['key']}" if ref else var["value"])
    return settings_from_args(_server_argv(container))


def _env_secret(container: dict[str, Any], name: str) -> tuple[str, str]:
    ref = next(v for v in container["env"] if v["name"] == name)["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


@pytest.mark.parametrize("pod", ["deployment", "lws-leader"])
def test_every_flag_and_variable_is_the_servers(pod: str, monkeypatch: pytest.MonkeyPatch) -> None:
    container = _container(_server_pods()[pod])
    options = {o for action in build_parser()._actions for o in action.option_strings}
    for var in container.get("env", []):
        name = var["name"]
        if name.startswith("MOE_SERVE_"):
            flag = "--" + name.removeprefix("MOE_SERVE_").lower().replace("_", "-")
            assert flag in options, f"{pod}: {name} is no server flag's variable ({flag})"
        elif not name.startswith("VLLM_"):
            assert name in OTHER_ENV, f"{pod}: unknown variable {name}"
        else:
            assert name in vllm.envs.environment_variables, name
    for arg in _server_argv(container):
        if arg.startswith("-"):
            assert arg.split("=")[0] in options, f"{pod}: {arg} is no server flag"
    settings = _settings(container, monkeypatch)  # parses and validates, as the server would
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert (settings.host, settings.port) == ("0.0.0.0", port)
    assert settings.api_keys == ("secret:api-key",) and settings.metrics_api_key == "secret:metrics-api-key"
    gpus = container["resources"]["requests"]["nvidia.com/gpu"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus == 8
    if pod == "deployment":
        assert settings.resolved_tensor_parallel_size() == gpus and settings.executor_backend is None
    else:
        size = _doc("leaderworkerset-ray.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
        assert settings.executor_backend == "ray"
        assert settings.resolved_tensor_parallel_size() * settings.pipeline_parallel_size == size * gpus


@pytest.mark.parametrize("pod", ["deployment", "lws-leader"])
def test_probes_drain_time_and_shared_memory(pod: str, monkeypatch: pytest.MonkeyPatch) -> None:
    template = _server_pods()[pod]
    container = _container(template)
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    drain = _settings(container, monkeypatch).drain_timeout_s
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    least = pre_stop + drain + ABORT_FLUSH_S + ENGINE_STOP_S
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert least <= grace <= least + 60, (grace, least)
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_selectors_ports_and_secrets_line_up() -> None:
    pods = _server_pods()
    deployment = _doc("deployment.yaml", "Deployment")
    labels = {"deployment": pods["deployment"]["metadata"]["labels"],
              "lws-leader": pods["lws-leader"]["metadata"]["labels"]}
    matches = lambda selector, pod: selector.items() <= labels[pod].items()  # noqa: E731
    assert matches(deployment["spec"]["selector"]["matchLabels"], "deployment")
    services = {"deployment": _doc("service.yaml", "Service"),
                "lws-leader": _doc("leaderworkerset-ray.yaml", "Service")}
    for pod, service in services.items():  # each Service reaches its own shape's servers only
        other = "lws-leader" if pod == "deployment" else "deployment"
        assert matches(service["spec"]["selector"], pod) and not matches(service["spec"]["selector"], other)
        names = {p["name"] for p in _container(pods[pod])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    monitor = _doc("podmonitor.yaml", "PodMonitor")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    auth = endpoint["authorization"]["credentials"]
    for pod in pods:  # one PodMonitor scrapes both shapes' servers, with the key their server checks
        assert matches(monitor["spec"]["selector"]["matchLabels"], pod)
        assert endpoint["port"] in {p["name"] for p in _container(pods[pod])["ports"]}
        assert _env_secret(_container(pods[pod]), "MOE_SERVE_METRICS_API_KEY") == (auth["name"], auth["key"])
    assert endpoint["path"] == "/metrics" and endpoint["authorization"]["type"] == "Bearer"
    assert matches(_doc("pdb.yaml", "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], "deployment")
    target = _doc("hpa.yaml", "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def test_ray_worker_joins_the_leaders_head() -> None:
    lwt = _doc("leaderworkerset-ray.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = _container(lwt["leaderTemplate"]), _container(lwt["workerTemplate"], "ray-worker")
    head_port = int(re.search(r"ray start --head --port=(\d+)", leader["command"][-1]).group(1))
    assert re.search(rf"ray start --address=\$LWS_LEADER_ADDRESS:{head_port}\b.*--block", worker["command"][-1])
    assert {"name": "ray-gcs", "containerPort": head_port} in leader["ports"]
    claims = [{v["persistentVolumeClaim"]["claimName"] for v in t["spec"]["volumes"] if "persistentVolumeClaim" in v}
              for t in (lwt["leaderTemplate"], lwt["workerTemplate"])]
    assert claims[0] == claims[1] != set()  # the model at the same path on both nodes


def _adapter_rule() -> dict[str, Any]:
    [rule] = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    return rule


def test_autoscaler_reads_what_the_adapter_serves() -> None:
    rule = _adapter_rule()
    [metric] = _doc("hpa.yaml", "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    assert re.fullmatch(rule["name"]["matches"], series)
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_paths_answer_on_the_real_server(strict_server: ServerProcess) -> None:
    """Probes carry no key; the PodMonitor sends the /metrics key; the adapter's series is there."""
    for pod in _server_pods().values():
        for probe in ("readinessProbe", "livenessProbe"):
            path = _container(pod)[probe]["httpGet"]["path"]
            assert httpx.get(strict_server.base_url + path, timeout=30).status_code == 200, path
    path = _doc("podmonitor.yaml", "PodMonitor")["spec"]["podMetricsEndpoints"][0]["path"]
    assert httpx.get(strict_server.base_url + path, timeout=30).status_code == 401  # the key is needed
    scrape = httpx.get(strict_server.base_url + path, timeout=30,
                       headers={"Authorization": f"Bearer {STRICT_METRICS_KEY}"})
    assert scrape.status_code == 200
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", _adapter_rule()["seriesQuery"]).group(0)
    assert re.search(rf"^{re.escape(series)}{{", scrape.text, re.M), series
