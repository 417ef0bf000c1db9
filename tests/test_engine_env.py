"""What the server leaves in its engine's environment (no NCCL / symmetric-memory / NVSHMEM switch
of its own, the plugin's mark); how its plugin serves on a vLLM whose internals do not match its
pins (vLLM's kernels, one warning, a metric); and vLLM's re-exported counters on a fresh server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moe_serve.kernels.plugin.vllm_plugin import ENABLE_ENV
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from tests.monitoring_helpers import scrape, value
from tests.plugin_env import plugin_server_env

pytestmark = pytest.mark.engine
MULTICAST_SWITCHES = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").iterdir():
            kids = [int(p) for p in (task / "children").read_text().split()]
            found += kids
            todo += kids
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def _engine_pids(server: ServerProcess) -> list[int]:
    return [p for p in _descendants(server.proc.pid)
            if b"moe_serve.service.grammar_worker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_the_engine_gets_no_multicast_switch_of_ours_and_the_plugin_mark(server: ServerProcess) -> None:
    """Every engine process (engine core, its workers): the three NVLink-multicast switches exactly
    as the user's environment has them (here: the test runner's), and the plugin's mark."""
    pids = _engine_pids(server)
    assert pids, "no engine process found"
    for pid in pids:
        env = _environ(pid)
        assert {k: env.get(k) for k in MULTICAST_SWITCHES} == {k: os.environ.get(k) for k in MULTICAST_SWITCHES}
        assert env.get(ENABLE_ENV) == "1", pid


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, str]]:
    """A fresh server on a vLLM whose internals do not match (the test plugin adds a failing pin in
    every process), after exactly one user request: (its /metrics samples, its log)."""
    tmp = tmp_path_factory.mktemp("mismatched")
    env = {**plugin_server_env(fail_pin="1", cpu_moe="1"), "MOE_SERVE_RUNTIME_DIR": str(tmp / "runtime")}
    srv = start_server(tmp, "--tensor-parallel-size", "1", env=env, ready_timeout=400)
    try:
        resp = httpx.post(srv.base_url + "/v1/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        yield scrape(srv.base_url), srv.log()
    finally:
        srv.stop()


def test_a_vllm_whose_internals_do_not_match_is_served_by_vllms_kernels(mismatched: tuple[dict, str]) -> None:
    """The server starts and serves; its worker reports mode vllm with no MoE hook and one failed
    pin; the log has one warning about it."""
    samples, log = mismatched
    assert value(samples, "moe_serve_plugin_vllm_pins_failed", rank="0") == 1
    workers = [dict(labels) for (name, labels) in samples if name == "moe_serve_vllm_worker_info"]
    assert [(w["mode"], w["moe_hook"]) for w in workers] == [("vllm", "absent")], workers
    assert value(samples, "moe_serve_moe_kernel_launches_total", path="optimized") == 0
    warnings = [line for line in log.splitlines() if "WARNING" in line and "pins" in line]
    assert len(warnings) == 1 and "vLLM's MoE kernels serve" in warnings[0], warnings


def test_vllms_request_counters_leave_the_warm_up_out(mismatched: tuple[dict, str]) -> None:
    """After the start-up warm-up (16 requests) and one user request, vLLM's re-exported counters
    say one request, as ours do."""
    samples, _ = mismatched
    assert value(samples, "moe_serve_requests_total") == value(samples, "moe_serve_requests_total", status="ok") == 1
    assert value(samples, "vllm:request_success_total") == 1
    assert value(samples, "vllm:prompt_tokens_total") == value(samples, "moe_serve_prompt_tokens_total") > 0
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 1
