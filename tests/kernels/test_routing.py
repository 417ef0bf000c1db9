"""Routing tables (kernels/moe/routing.py, built by kernels/tuning/make_routing.py) and the route
moe_serve.kernels.moe.selection takes from them; the plugin's use of it is in test_layer_warmup.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.kernels.moe.config_schema import label
from moe_serve.kernels.tuning import make_routing

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "kernels/moe/configs" / routing.file_name("NVIDIA_H200")
SHIPPED_TABLE = json.loads(SHIPPED.read_text())
SHIPPED_TRITON = SHIPPED_TABLE["triton_version"]   # the shipped tables are refused under another
RESULTS = [ROOT / src for src in SHIPPED_TABLE["sources"]]  # its raw files
D = 0.03                                            # spread for the rule tests: e^0.03 = 1.0305


def _routes(points: dict[int, float | None]) -> dict[int, str]:
    return {m: b for m, (b, _) in make_routing.decide_points(points, D).items()}


def test_a_route_flips_only_beyond_the_spread_and_keeps_it_inside():
    r = _routes({1: 1.02, 2: 1.10, 4: 1.01, 8: 0.99, 16: 0.95, 32: 1.02, 64: 1.05})
    assert r == {1: "vllm",      # within the spread: keeps the start (vLLM)
                 2: "ours", 4: "ours", 8: "ours",    # 1.01 and 0.99 are noise: no flip back
                 16: "vllm",     # 0.95 is beyond it
                 32: "vllm",     # noise again: stays
                 64: "ours"}
    why = make_routing.decide_points({2: 1.10, 4: 1.01}, D)
    assert "within the spread" in why[4][1] and "ours faster" in why[2][1]


def test_a_lone_flip_close_to_the_band_follows_its_neighbours_a_far_one_stays():
    assert _routes({1: 1.2, 2: 1.2, 4: 0.95, 8: 1.2}) == {1: "ours", 2: "ours", 4: "ours", 8: "ours"}
    assert _routes({1: 1.2, 2: 1.2, 4: 0.90, 8: 1.2})[4] == "vllm"    # |ln 0.90| >= 2 x spread
    assert _routes({1: 0.8, 2: 1.05, 4: 0.8})[2] == "vllm"            # a lone win as well
    assert _routes({1: 0.8, 2: 1.10, 4: 0.8})[2] == "ours"
    assert _routes({1: 1.2, 2: None, 4: 1.2})[2] == "vllm"            # an error is never smoothed
    assert _routes({1: 1.2, 2: 0.95})[2] == "vllm"                    # the last point has one neighbour


def test_where_only_vllms_kernel_fails_ours_serves():
    """vLLM's block-FP8 kernel cannot run N % 128 != 0 (Qwen3-235B-A22B at TP = 8: N = 192);
    a point where it raised and ours ran routes to ours, one where ours raised stays vLLM's."""
    measured = {"1": {"ours_us": 15.6, "vllm_us": None, "speedup": None, "vllm_error": "AssertionError"},
                "2": {"ours_us": 20.1, "vllm_us": None, "speedup": None, "vllm_error": "AssertionError"},
                "4": {"ours_us": None, "speedup": None, "error": "OutOfResources"}}
    ranges = make_routing.route_measured(measured, D)
    assert routing.route_in(ranges, 1) == routing.route_in(ranges, 2) == "ours"
    assert routing.route_in(ranges, 4) == "vllm" and "failed" in measured["1"]["why"]
    table = make_routing.build([{"format-bench": [
        {"shape": "Qwen3-235B-A22B/TP8", "dtype": "bf16", "M": 1, "ours_us": 15.6,
         "vllm_error": "AssertionError: 192 % 128", "cfg": "x"}]}], "NVIDIA_H200", [], "3.6.0")
    (ent,) = table["shapes"].values()
    assert ent["measured"]["1"]["vllm_error"] and routing.route_in(ent["ranges"], 1) == "ours"


def test_ranges_between_and_outside_the_measured_m():
    r = make_routing.build_ranges({1: 1.10, 2: 1.2, 4: 1.05, 16: 0.9, 64: 1.3, 256: None}, D)
    assert routing.route_in(r, 3) == "ours"          # both neighbours ours, 2x apart
    assert routing.route_in(r, 5) == "vllm"          # 16 is vLLM
    assert routing.route_in(r, 40) == "vllm"         # 16 -> 64 is 4x apart: not interpolated
    assert routing.route_in(r, 64) == "ours" and routing.route_in(r, 65) == "vllm"   # 256 errored
    assert routing.route_in(r, 10 ** 6) == "vllm"    # above the largest measured M
    assert r[-1] == {"m_min": 65, "m_max": None, "backend": "vllm"}  # merged
    assert make_routing.build_ranges({2: 1.5}, D)[0] == {"m_min": 1, "m_max": 1, "backend": "vllm"}
    assert make_routing.build_ranges({1: 1.029}, D) == [{"m_min": 1, "m_max": None, "backend": "vllm"}]


def test_beside_points_where_only_vllms_kernel_failed_unmeasured_m_stay_ours():
    """vLLM's failure (N % 128 != 0 for its block-FP8 kernel) is the shape's, so M outside the
    measured ones and wide gaps between two such points route to ours, not to the raising kernel."""
    inf = math.inf
    assert make_routing.build_ranges({2: inf, 256: inf}, D) == [{"m_min": 1, "m_max": None, "backend": "ours"}]
    r = make_routing.build_ranges({1: 1.2, 4: inf, 64: 1.2}, D)
    assert routing.format_ranges(r) == "1:ours,2-3:vllm,4:ours,5-63:vllm,64:ours,65+:vllm"
    assert routing.route_in(make_routing.build_ranges({1: inf, 2: 0.8}, D), 10 ** 6) == "vllm"


def test_the_two_range_islands_of_the_old_threshold_rule_are_gone():
    """Qwen3-30B-A3B/TP1 bf16 as measured on the H200 on 2026-12-01 (before its re-tune): the
    1.02 threshold rule made '1:vllm,2-512:ours,513-1023:vllm,1024-4096:ours' of a single 0.976
    reading at M=768."""
    points = {1: 0.9084, 2: 1.1197, 3: 1.0782, 4: 1.0937, 6: 1.0304, 8: 1.0583, 12: 1.0317,
              16: 1.057, 24: 1.0381, 32: 1.0318, 48: 1.0396, 64: 1.0514, 96: 1.0266, 128: 1.0368,
              192: 1.0637, 256: 1.0823, 384: 1.1286, 512: 1.048, 768: 0.976, 1024: 1.0626,
              2048: 1.1017, 4096: 1.1102}
    assert routing.format_ranges(make_routing.build_ranges(points, D)) == "1:vllm,2-4096:ours,4097+:vllm"


def test_spread_is_measured_from_repeated_cells_else_the_default():
    few = {("a", "bf16", m, "c"): [1.0, 1.1] for m in range(make_routing.MIN_REPEATS - 1)}
    assert make_routing.measured_spread(few)[0] == make_routing.DEFAULT_SPREAD
    cells = {("a", "bf16", m, "c"): [1.0, math.exp(0.001 * m)] for m in range(1, 21)}
    cells[("a", "bf16", 99, "c")] = [1.0]                              # one reading: no repeat
    d, where = make_routing.measured_spread(cells)
    assert d == pytest.approx(0.019) and "20 repeated cells" in where  # 90th percentile
    tight = {("a", "bf16", m, "c"): [1.0, 1.0001] for m in range(10)}
    assert make_routing.measured_spread(tight)[0] == make_routing.MIN_SPREAD


def test_build_averages_a_cells_readings_with_its_last_config():
    row = dict(shape="Mixtral-8x7B/TP8", dtype="bf16", M=1, ours_us=10.0, vllm_us=12.0)
    results = [{"bench": [{**row, "speedup": 1.10, "cfg": "a"}]},
               {"bench": [{**row, "speedup": 1.21, "cfg": "b"}]},
               {"bench": [{**row, "speedup": 1.00, "cfg": "b"}, {**row, "shape": "not-named", "speedup": 2.0}]}]
    table = make_routing.build(results, "dev", [], "9.9", spread=D)
    (key, ent), = table["shapes"].items()
    assert key == "E=8,N=1792,K=4096,dtype=bf16" and table["triton_version"] == "9.9"
    point = ent["measured"]["1"]
    assert point["speedup"] == pytest.approx(math.sqrt(1.21)) and point["readings"] == 2
    assert point["cfg"] == "b" and point["route"] == "ours" and "beyond the spread" in point["why"]


def test_shipped_table_is_generated_from_the_results():
    table = make_routing.build([json.loads(p.read_text()) for p in RESULTS], "NVIDIA_H200", [],
                               SHIPPED_TRITON)
    assert table["spread"] == SHIPPED_TABLE["spread"] and table["spread_from"].startswith("measured")
    assert {k: v["ranges"] for k, v in table["shapes"].items()} == \
        {k: v["ranges"] for k, v in SHIPPED_TABLE["shapes"].items()}


def _refined(E: int, N: int, K: int, dtype: str, m: int, device: str, triton_version: str) -> dict:
    """The shipped table's record of `moe-serve tune --refine` for M's bucket ({} if none)."""
    found = configs.find_table(E, N, K, dtype, device, triton_version)
    if found.path is None:
        return {}
    refined = json.loads(found.path.read_text()).get("refined", {})
    return refined.get("buckets", {}).get(str(configs.bucket_of(m)), {})


@pytest.mark.parametrize("path", sorted(SHIPPED.parent.glob("routing,device=*.json")), ids=lambda p: p.stem)
def test_routed_to_ours_configs_are_the_measured_ones(path: Path):
    """Every measured M routed to ours still gets the config that was measured (the shared
    memory fit must not have changed a winning config), or the one `moe-serve tune --refine`
    measured faster than it (the table records the refinement: before = the routed config), in
    every shipped routing table (one per GPU).
    Checked where the config does not depend on the machine: tuned tables and the decode
    heuristic. (An untuned shape's aligned config comes from vLLM's lookup for the GPU it runs
    on, which a CPU cannot reproduce.)"""
    table = json.loads(path.read_text())
    device, triton_version = table["device"], table["triton_version"]
    n = 0
    for key, ent in table["shapes"].items():
        E, N, K = (int(p.split("=")[1]) for p in key.split(",")[:3])
        dt = key.split("dtype=")[1]
        for m, meas in ent["measured"].items():
            if routing.route_in(ent["ranges"], int(m)) != "ours":
                continue
            choice = selection.config_choice(int(m), E, N, K, ent["topk"], dt, device,
                                             triton_version=triton_version)
            if choice.source == selection.DEFAULT_RULE and not choice.config.get("DECODE"):
                continue
            served, ref = label(choice.config), _refined(E, N, K, dt, int(m), device, triton_version)
            assert served == meas["cfg"] or (ref.get("before") == meas["cfg"]
                                             and ref.get("after") == served
                                             and ref["after_us"] < ref["before_us"]), (key, m)
            assert choice.shrunk == ()
            n += 1
    assert n >= 5


def test_route_unmeasured_and_policy(monkeypatch):
    def route(*a, **k):
        return selection.route(*a, **k, triton_version=SHIPPED_TRITON)

    assert route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "vllm"     # never measured
    assert route(3, 48, 64, "bf16", 1, "NVIDIA_H200", topk=1) == "ours"   # default rule
    assert route(3, 48, 64, "bf16", 4, "NVIDIA_H200", topk=1) == "vllm"   # 4 > E
    assert route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "ours"  # Qwen3 fp8 M=4
    assert route(8, 1792, 4096, "fp8", 1, "NVIDIA_H200") == "ours"  # Mixtral fp8 M=1
    assert route(8, 1792, 4096, "fp8", 64, "NVIDIA_H200") == "vllm"  # M=64: 0.977x
    assert route(8, 1792, 4096, "bf16", 1, "some_gpu") == "vllm"    # no table
    monkeypatch.setenv(routing.ROUTING_ENV, "ours")
    assert route(3, 48, 64, "bf16", 1, "NVIDIA_H200") == "ours"
    monkeypatch.setenv(routing.ROUTING_ENV, "vllm")
    assert route(128, 96, 2048, "fp8", 4, "NVIDIA_H200") == "vllm"


def test_routing_table_of_another_triton_is_refused(caplog):
    with caplog.at_level("WARNING"):
        loaded = routing.load("NVIDIA_H200", "0.0.1-other")
    assert loaded["shapes"] == {} and str(SHIPPED) in loaded["refused"][0]
    assert "moe-serve tune" in caplog.text
    rc = selection.route_choice(128, 96, 2048, "fp8", 4, "NVIDIA_H200", topk=8, triton_version="0.0.1-other")
    assert rc.rule.startswith(selection.DEFAULT_RULE) and "refused" in rc.rule
    assert configs.find_table(128, 96, 2048, "fp8", "NVIDIA_H200", "0.0.1-other").table is None


def test_tune_routes_to_ours_where_vllms_kernel_raises(monkeypatch):
    """`moe-serve tune`'s routing step records vLLM's failure instead of dying on it (the whole
    tune was lost that way on the H200 for a block-FP8 N = 192 shard) and routes those M to ours."""
    import time

    from moe_serve.kernels.tuning import tune_cli
    from moe_serve.kernels.tuning.model_shapes import MoEShape

    def fails(prob, replays):
        raise AssertionError("the last dimension of `x` 192 must be divisible by `group_size` 128")
    monkeypatch.setattr(tune_cli, "time_vllm", fails)
    monkeypatch.setattr(tune_cli, "ROUTE_MS", (1, 2))
    shape = MoEShape("tiny", 8, 32, 64, 2, "fp8", 1)
    ent = tune_cli._route_shape(shape, "cpu", 2, time.perf_counter() + 600, True, 2)
    assert all(p["vllm_error"].startswith("AssertionError") and p["ours_us"] > 0
               for p in ent["measured"].values()), ent
    assert routing.route_in(ent["ranges"], 1) == routing.route_in(ent["ranges"], 2) == "ours"
    assert "vLLM failed" in tune_cli._summary(shape, ent, 1.0)
