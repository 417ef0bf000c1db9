"""Helpers for the monitoring tests: scrape /metrics, read the shipped PromQL, run a real Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.loadtest.server_proc import REPO, free_port

MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "moe-serve.json"
ALERTS = MONITORING / "alerts.yml"
PROMETHEUS_YML = MONITORING / "prometheus.yml"
# Families the vLLM workers' plugin reports (kernels/plugin/plugin_metrics.py), not service/metrics.py.
PLUGIN_FAMILIES = ("moe_serve_triton_jit_compiles_total", "moe_serve_moe_kernel_info",
                   "moe_serve_plugin_warmup_failures_total")
SampleKey = tuple[str, frozenset]


def parse_metrics(text: str) -> dict[SampleKey, float]:
    """Prometheus text -> {(sample name, labels): value}; raises on a duplicate sample."""
    samples: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            if key in samples:
                raise AssertionError(f"duplicate sample {key}")
            samples[key] = s.value
    return samples


def scrape(base_url: str, headers: Mapping[str, str] | None = None) -> dict[SampleKey, float]:
    resp = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def value(samples: dict[SampleKey, float], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(before: dict[SampleKey, float], after: dict[SampleKey, float], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


EXPERT_LOAD_PATH = "/v1/moe/expert-load"


def fresh_expert_load(base_url: str, headers: Mapping[str, str] | None = None, method: str = "GET",
                      path: str = EXPERT_LOAD_PATH, timeout: float = 30.0) -> dict:
    """The expert load endpoint's body once every worker snapshot merged is younger than this call
    (workers snapshot every second): everything the engine did before the call is in it."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.request(method, base_url + path, headers=headers, timeout=30)
        resp.raise_for_status()
        body = resp.json()
        if body["as_of"] is not None and body["as_of"] > since:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker snapshot after {since}: as_of {body['as_of']}")
        time.sleep(0.2)


def served_forward_tokens(samples: dict[SampleKey, float]) -> float:
    """Tokens the model's forwards ran for the served requests, from the route metrics (warm-up
    requests are not in them): prompt + generated - finished sequences (a sequence's last token is
    sampled, never fed back). Exact for n = 1 and prompts shorter than a KV block (no prefix-cache
    hit)."""
    return (value(samples, "moe_serve_prompt_tokens_total") + value(samples, "moe_serve_generation_tokens_total")
            - value(samples, "moe_serve_finish_reasons_total"))


@dataclass(frozen=True)
class Expr:
    """One PromQL expression shipped in monitoring/ (where it comes from, and the text)."""

    source: str
    promql: str

    @property
    def uses_plugin_metrics(self) -> bool:
        return any(f.removesuffix("_total") in self.promql for f in PLUGIN_FAMILIES)


def dashboard_exprs() -> list[Expr]:
    """Every panel target's expr, plus the template variables' label_values() queries as PromQL."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append(Expr(f"panel '{panel['title']}' {target['refId']}", target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, f"unsupported variable query {var['definition']}"
            exprs.append(Expr(f"variable {var['name']}", f"group by ({m[2]}) ({m[1]})"))
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def split_threshold(promql: str) -> tuple[str, str, float]:
    """'<signal> <op> <number>' -> (signal, op, number): alert rules are written in this form."""
    m = re.fullmatch(r"(?s)\s*(.+?)\s*(>=|<=|==|!=|>|<)\s*([0-9.eE+-]+)\s*", promql)
    assert m, f"alert expression is not '<signal> <op> <threshold>': {promql}"
    return m[1], m[2], float(m[3])


def alert_exprs() -> list[Expr]:
    return [Expr(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def substitute_grafana_vars(promql: str, model: str, rate_interval: str) -> str:
    """Replace the dashboard's template variables the way Grafana would for one model (every MoE
    layer: the variable's 'All')."""
    return promql.replace("$__rate_interval", rate_interval).replace("$model", model).replace("$layer", ".*")


class Prometheus:
    """A real Prometheus (Debian package) scraping `target` with the shipped config, 1 s intervals
    (with `bearer` as the scrape's `Authorization: Bearer` credentials where the server needs a key)."""

    def __init__(self, workdir: Path, target: str, interval: str = "1s", bearer: str | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not installed: run `bash service/setup.sh --test` "
                               "(apt-get install prometheus)")
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"] = {**config.get("global", {}), "scrape_interval": interval, "evaluation_interval": interval}
        for job in config["scrape_configs"]:
            for sd in job.get("file_sd_configs", []):
                sd["refresh_interval"] = interval
            if bearer:
                job["authorization"] = {"credentials": bearer}
        (workdir / "targets").mkdir(parents=True, exist_ok=True)
        (workdir / "targets" / "moe-serve.yml").write_text(yaml.safe_dump([{"targets": [target]}]))
        for rule_file in config.get("rule_files", []):
            shutil.copy(MONITORING / rule_file, workdir / rule_file)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready:\n{self.log_path.read_text()[-3000:]}")

    def query(self, promql: str) -> list[dict]:
        """Instant query; raises unless Prometheus answers status success."""
        resp = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=30)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"query failed: {promql}: {body.get('error', resp.text)}")
        return body["data"]["result"]

    def wait_for(self, promql: str, ok, timeout: float = 30.0) -> list[dict]:
        """Poll `promql` until ok(result) holds; return the last result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if ok(result) or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def rules(self) -> list[dict]:
        body = httpx.get(self.url + "/api/v1/rules", timeout=10).json()
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
