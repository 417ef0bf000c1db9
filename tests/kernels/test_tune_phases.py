"""moe_serve.kernels.tuning.tune.tune_shape's search logic with a stand-in cost (no GPU): phase D gives a bucket
its neighbour's winner when one-dimension walks cannot reach it; the decode family wins the
buckets where it is cheaper; a resumed search skips the phases it already finished; a refine
(moe_serve.kernels.tuning.refine) runs only the phases named."""
from __future__ import annotations

from pathlib import Path

import pytest

from moe_serve.kernels.moe import configs, heuristics
from moe_serve.kernels.tuning import candidates, precompile, refine, tune

E, N, K, TOPK = 8, 1792, 4096, 2


def _stub(monkeypatch, cost) -> list[tuple[int, dict]]:
    for module in (tune, refine):
        monkeypatch.setattr(module, "make_problem", lambda *a, **k: {"M": a[4], "weights": None})
    monkeypatch.setattr(precompile, "compiles_ok", lambda *a: True)
    timed: list[tuple[int, dict]] = []

    def cost_us(prob: dict, cfg: dict, replays: int = 20) -> float:
        timed.append((prob["M"], cfg))
        return cost(prob["M"], configs.validate(cfg))

    monkeypatch.setattr(tune, "time_ours", cost_us)
    return timed


def test_neighbours_winner_reaches_a_bucket_the_one_dim_walk_cannot(monkeypatch) -> None:
    base = configs.aligned_default(128, E, N, K, TOPK, "bf16", "cpu")
    # two GEMM1 dimensions away from bucket 128's start: phase B moves one at a time
    far = configs.validate({**base, "BLOCK_K": 64 if base["BLOCK_K"] == 128 else 128,
                            "num_stages": 3 if base["num_stages"] != 3 else 4})
    assert candidates.legal(far, N, K, TOPK, "bf16")
    start = configs.aligned_default
    monkeypatch.setattr(configs, "aligned_default",
                        lambda M, *a, **k: far if M == 256 else start(M, *a, **k))
    timed = _stub(monkeypatch, lambda M, c: {256: 1.0 if c == far else 2.0,
                                             128: 1.5 if c == far else 2.0}.get(M, 2.0))
    table = tune.tune_shape(E, N, K, TOPK, "bf16", (64, 128, 256), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False)
    assert configs.validate(table[256]) == far
    assert configs.validate(table[128]) == far      # only phase D offers it to bucket 128
    assert any(m == 128 and configs.validate(c) == far for m, c in timed)


def test_decode_family_wins_where_cheaper_and_resume_skips_done_phases(monkeypatch) -> None:
    _stub(monkeypatch, lambda M, c: (1.0 if c.get("DECODE") else 2.0) if M <= 2 else
          (3.0 if c.get("DECODE") else 2.0))
    saved: list[dict] = []
    table = tune.tune_shape(E, N, K, TOPK, "bf16", (1, 2, 16), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False,
                            on_phase=lambda st: saved.append({"done": list(st["done"])}))
    assert table[1].get("DECODE") and table[2].get("DECODE") and not table[16].get("DECODE")
    assert table[1]["BLOCK_M"] >= 1 * TOPK and table[2]["BLOCK_M"] >= 2 * TOPK
    assert saved[-1]["done"][0] == "starts" and "D neighbours" in saved[-1]["done"]
    # resume: every phase done -> nothing is timed again, the saved winners are returned
    state = {"done": saved[-1]["done"], "best": {"decode": {1: [1.0, table[1]]},
                                                 "aligned": {16: [2.0, table[16]]}}}
    timed = _stub(monkeypatch, lambda M, c: 0.5)
    again = tune.tune_shape(E, N, K, TOPK, "bf16", (1, 16), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False, state=state)
    assert timed == [] and again[1] == table[1] and again[16] == table[16]


def test_decode_defaults_hold_all_slots() -> None:
    for M in (1, 2, 4, 8):
        assert heuristics.decode_config(M, 128, 96, 2048, 8, "fp8")["BLOCK_M"] >= M * 8


def test_block_fp8_is_tuned_as_its_own_format_with_block_k_the_group(monkeypatch,
                                                                     tmp_path: Path) -> None:
    """Every block-FP8 candidate timed has BLOCK_K = the activation group in both GEMMs (the
    BLOCK_K walks collapse; GEMV candidates: a multiple of it), the quantize-once flip is offered
    on both paths, and the table is written under vLLM's format name."""
    from moe_serve.kernels.moe import quant_format

    key = quant_format.block_key(128, 128)
    timed = _stub(monkeypatch, lambda M, c: 1.0 + (0.5 if c.get("DECODE") else 0.0) * (M > 1))
    table = tune.tune_shape(256, 256, 7168, 8, key, (1, 16), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False)
    mma = [c for _, c in timed if not c.get("GEMV")]
    assert mma and all(configs.block_k_of(c) == {128} for c in mma)
    gemv = [c for _, c in timed if c.get("GEMV")]
    assert gemv and all(b % 128 == 0 for c in gemv for b in configs.block_k_of(c))
    assert {b for c in gemv for b in configs.block_k_of(c)} > {128}     # wider steps timed
    assert {bool(c.get("DECODE")) for _, c in timed} == {True, False}
    pre = {(bool(c.get("DECODE")), c.get("A_PREQUANT")) for _, c in timed}
    assert (True, True) in pre and (False, False) in pre      # both flips were timed
    assert all(configs.block_k_of(c) == {128} for c in table.values() if not c.get("GEMV"))
    path = tune.write_table(table, 256, 256, 7168, key, tmp_path, "dev")
    assert path.name == "E=256,N=256,K=7168,dtype=fp8_w8a8,block_shape=[128,128],device=dev.json"



def test_joint_occupancy_phases_reach_what_one_dimension_walks_cannot(monkeypatch) -> None:
    """The decode up kernel's best here needs split-K 2 with 3 stages and BLOCK_K 64 together
    (each alone costs more), the down kernel's a wider tile with fewer splits and 2 stages: only
    the joint phases offer them."""
    start = configs.validate(heuristics.decode_config(1, E, N, K, TOPK, "bf16"))
    up = {"SPLIT_K": 2, "num_stages": 3, "BLOCK_K": 64}
    down = {"BLOCK_N": 128 if start["DOWN"]["SWAP_AB"] else 64, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 2}

    def cost(M: int, c: dict) -> float:
        if not c.get("DECODE"):
            return 9.0
        hit_up = all(c.get(k, 1) == v for k, v in up.items())
        hit_down = all(c["DOWN"].get(k, 1) == v for k, v in down.items())
        return 5.0 - 2.0 * hit_up - 1.0 * hit_down

    assert candidates.legal({**start, **up}, N, K, TOPK, "bf16")
    _stub(monkeypatch, cost)
    table = tune.tune_shape(E, N, K, TOPK, "bf16", (1,), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False)
    got = configs.validate(table[1])
    assert all(got.get(k) == v for k, v in up.items()), got
    assert all(got["DOWN"].get(k) == v for k, v in down.items()), got["DOWN"]
    grid = candidates.decode_up_occupancy(start)
    assert start not in grid and len(grid) == len({str(sorted(c.items())) for c in grid})
    assert all(c["DOWN"] == start["DOWN"] for c in grid)
    assert all(c["DOWN"] != start["DOWN"] for c in candidates.decode_down_occupancy(start))


def test_gemv_family_wins_where_cheaper_within_its_slot_limit(monkeypatch) -> None:
    """The CUDA-core family is seeded and walked only where M * topk <= GEMV_TUNE_MAX_SLOTS; a
    bucket it wins gets a GEMV config, and its walks reach a tile two dimensions from the seed
    (up BLOCK_N 8 with 8 warps and split-K 2; down 4 rows with split-K 8)."""
    def cost(M: int, c: dict) -> float:
        if not c.get("GEMV"):
            return 3.0
        d = c["DOWN"]
        return (2.0 - 0.5 * (c["BLOCK_N"] == 8) - 0.25 * (c["num_warps"] == 8 and c["SPLIT_K"] == 2)
                - 0.125 * (d["BLOCK_N"] == 4) - 0.0625 * (d["SPLIT_K"] == 8))

    timed = _stub(monkeypatch, cost)
    table = tune.tune_shape(E, N, K, TOPK, "bf16", (1, 16, 32), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False)
    got = table[1]
    assert got.get("GEMV") and (got["BLOCK_N"], got["num_warps"], got["SPLIT_K"]) == (8, 8, 2)
    assert (got["DOWN"]["BLOCK_N"], got["DOWN"]["SPLIT_K"]) == (4, 8)
    assert table[16].get("GEMV") and not table[32].get("GEMV")    # 32 x 2 slots > 32
    assert not any(c.get("GEMV") for m, c in timed if m * TOPK > tune.GEMV_TUNE_MAX_SLOTS)


def test_refine_takes_a_mode_only_where_faster_beyond_the_margin(monkeypatch) -> None:
    """`moe-serve tune --refine`: each bucket's table config through the named phase only, kept
    unless a candidate beats it by more than refine.MIN_GAIN; an aligned bucket gets no decode
    phase; an unknown phase is refused by name."""
    decode = configs.validate(heuristics.decode_config(1, E, N, K, TOPK, "bf16"))
    aligned = configs.aligned_default(64, E, N, K, TOPK, "bf16", "cpu")
    table = {1: decode, 2: decode, 64: aligned}
    # M = 1: mode 2 is 10 % faster; M = 2: mode 1 is faster by less than the margin
    timed = _stub(monkeypatch, lambda M, c: {(1, 2): 0.9, (2, 1): 0.995}.get(
        (M, c.get("PREFETCH", 0)), 1.0))
    out, report = refine.refine_table(E, N, K, TOPK, "bf16", table, ["decode prefetch"],
                                      (1, 2, 64), budget_s=600, device="cpu", log=lambda s: None)
    assert out[1]["PREFETCH"] == 2 and report[1]["after_us"] == 0.9
    assert "PREFETCH" not in out[2] and report[2]["before"] == report[2]["after"]
    assert out[64] == configs.fit(aligned, "bf16", topk=TOPK)   # no decode phase applies
    assert sorted({m for m, _ in timed}) == [1, 2, 64]
    assert [c.get("PREFETCH", 0) for m, c in timed if m == 1] == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown phase"):
        refine.refine_table(E, N, K, TOPK, "bf16", table, ["no such phase"], (1,), 600, "cpu")
