"""Routing table (kernels/moe/routing.py, kernels/tuning/make_routing.py); the plugin's use of it is in
tests/test_layer_warmup.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernels.moe import configs, routing
from kernels.tuning import make_routing
from kernels.moe.config_schema import label

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "kernels/moe/configs" / routing.file_name("NVIDIA_H200")
sys.path.insert(0, str(ROOT / "bench"))
from results_archive import raw  # noqa: E402  (a closed date's raw files are in its archive)

RESULTS = [raw(src.removeprefix("bench/results/")) for src in json.loads(SHIPPED.read_text())["sources"]]


def test_ranges_are_conservative():
    r = make_routing.build_ranges({1: 1.10, 2: 1.2, 4: 1.05, 16: 1.01, 64: 1.3, 256: None})
    assert routing.route_in(r, 1) == "ours"
    assert routing.route_in(r, 3) == "ours"          # both neighbours >= 1.02, 2x apart
    assert routing.route_in(r, 4) == "ours"
    assert routing.route_in(r, 5) == "vllm"          # 16 is below the threshold
    assert routing.route_in(r, 16) == "vllm"
    assert routing.route_in(r, 40) == "vllm"
    assert routing.route_in(r, 64) == "ours"         # measured point itself
    assert routing.route_in(r, 65) == "vllm"         # 256 errored
    assert routing.route_in(r, 10 ** 6) == "vllm"    # above the largest measured M
    assert r[-1] == {"m_min": 65, "m_max": None, "backend": "vllm"}  # merged
    assert make_routing.build_ranges({1: 1.019}) == [{"m_min": 1, "m_max": None, "backend": "vllm"}]
    wide = make_routing.build_ranges({256: 1.1, 4096: 1.1})   # 16x apart: no interpolation
    assert routing.route_in(wide, 512) == "vllm" and routing.route_in(wide, 4096) == "ours"


@pytest.mark.skipif(not all(p.exists() for p in RESULTS), reason="H200 results not in the tree")
def test_shipped_table_is_generated_from_the_results():
    table = make_routing.build([json.loads(p.read_text()) for p in RESULTS], "NVIDIA_H200", [])
    shipped = json.loads(SHIPPED.read_text())
    assert {k: v["ranges"] for k, v in table["shapes"].items()} == \
        {k: v["ranges"] for k, v in shipped["shapes"].items()}


def test_routed_to_ours_configs_are_the_measured_ones():
    """Every measured M routed to ours still gets the config that was measured (the shared
    memory fit must not have changed a winning config). Checked where the config does not
    depend on the machine: tuned tables and the decode heuristic. (An untuned shape's aligned
    config comes from vLLM's lookup for the GPU it runs on, which a CPU cannot reproduce.)"""
    shipped = json.loads(SHIPPED.read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    n = 0
    for key, ent in shipped["shapes"].items():
        E, N, K = (int(p.split("=")[1]) for p in key.split(",")[:3])
        dt = key.split("dtype=")[1]
        for m, meas in ent["measured"].items():
            if routing.route_in(ent["ranges"], int(m)) != "ours":
                continue
            cfg = configs.get_config(int(m), E, N, K, ent["topk"], dt, "NVIDIA_H200")
            if not (configs.load_table(E, N, K, dt, "NVIDIA_H200") or cfg.get("DECODE")):
                continue
            assert label(cfg) == meas["cfg"], (key, m)
            n += 1
    assert n >= 5


def test_route_unmeasured_and_policy(monkeypatch):
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "vllm"     # never measured
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200", topk=1) == "ours"   # default rule
    assert routing.route(3, 48, 64, "bf16", 4, "NVIDIA_H200", topk=1) == "vllm"   # 4 > E
    assert routing.route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "ours"  # Qwen3 fp8 M=4
    assert routing.route(8, 1792, 4096, "fp8", 1, "NVIDIA_H200") == "ours"  # Mixtral fp8 M=1
    assert routing.route(8, 1792, 4096, "fp8", 64, "NVIDIA_H200") == "vllm"  # M=64: < 1.02x
    assert routing.route(8, 1792, 4096, "bf16", 1, "some_gpu") == "vllm"    # no table
    monkeypatch.setenv(routing.ROUTING_ENV, "ours")
    assert routing.route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "ours"
    monkeypatch.setenv(routing.ROUTING_ENV, "vllm")
    assert routing.route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "vllm"
