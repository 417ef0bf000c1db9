"""bench/experts/fp8.py's parts on CPU (interpreter): the block-FP8 correctness part checks every
variant against the float64 references and fails rows it should; the forced aligned part times
both quantization variants and, where the untuned tile is BLOCK_M = 32, the candidate tiles, each
checked against a reference output first; the floor's byte count includes the scales."""
from __future__ import annotations

import torch

from moe_serve.bench.experts import fp8 as kernels_fp8
from moe_serve.kernels.moe import quant_format

SHAPE = {"tiny": (8, 32, 64, 2)}


def test_block_correctness_rows_cover_every_variant_and_pass():
    rows = kernels_fp8.part_block_correctness(SHAPE, (1, 9), "cpu", True, lambda *a: None)
    names = {r["variant"] for r in rows}
    assert {"served", "served-fp8in", "aligned-prequant", "aligned-inloop", "aligned-split",
            "decode", "decode-prequant", "decode-swap", "decode-epilogue-quant"} <= names
    assert all(r["ok"] and r["err_qaware"] < kernels_fp8.TOL_QAWARE for r in rows), rows
    assert all("err_vs_vllm" not in r for r in rows)          # no vLLM on the CPU: no number


def test_block_correctness_fails_a_wrong_kernel(monkeypatch):
    """A kernel whose output is off (scales ignored) is reported as failing, not passed."""
    from moe_serve.kernels.moe import fused_moe as fm

    real = fm.fused_moe

    def wrong(*a, **kw):
        out = real(*a, **kw)
        out.mul_(1.5)
        return out
    monkeypatch.setattr(fm, "fused_moe", wrong)
    rows = kernels_fp8.part_block_correctness(SHAPE, (1,), "cpu", True, lambda *a: None)
    assert rows and not any(r["ok"] for r in rows)


def test_fp8_aligned_times_quantize_once_and_in_loop():
    from moe_serve.bench.experts.problem import problem as _problem

    rows = kernels_fp8.part_fp8_aligned(SHAPE, (8,), 2, 3, "cpu", _problem, lambda *a: None)
    assert [r["dtype"] for r in rows] == ["fp8", quant_format.PER_TOKEN]
    assert all(r["ours_once_us"] > 0 and r["ours_inloop_us"] > 0 and "vllm_us" not in r
               for r in rows), rows


def _base(M: int, shape: tuple, fmt: str = "fp8") -> dict:
    from moe_serve.kernels.moe import configs

    return configs.fit(configs.aligned_default(configs.bucket_of(M), *shape, fmt), fmt, topk=shape[3])


def test_aligned_candidates_only_for_block_m_32():
    shape = SHAPE["tiny"]
    assert _base(8, shape)["BLOCK_M"] != 32 and kernels_fp8.aligned_candidates(_base(8, shape), *shape, "fp8") == {}
    base = _base(128, shape)                       # 256 slots over 8 experts: 32 tokens each
    assert base["BLOCK_M"] == 32
    cands = kernels_fp8.aligned_candidates(base, *shape, "fp8")
    assert set(cands) == {"swap", "swap_unfused", "bm64"}
    assert cands["swap"]["SWAP_AB"] and cands["swap"]["BLOCK_N"] == 64
    assert not cands["swap_unfused"]["FUSE_GU"]


def test_candidate_check_passes_a_right_kernel_and_fails_a_wrong_one(monkeypatch):
    from moe_serve.bench.experts.problem import problem as _problem
    from moe_serve.kernels.moe import fused_moe as fm

    shape = SHAPE["tiny"]
    prob = _problem(shape, 16, "fp8", 1, None)
    x, tw, ids = prob["sets"][0]
    base = _base(16, shape)
    ref = torch.full_like(x, float("nan"))
    fm.fused_moe(x, *prob["weights"][:2], tw, ids, fp8=prob["fp8"], out=ref,
                 config={**base, "A_PREQUANT": False})
    assert kernels_fp8._check_vs_vllm(prob, base, ref) < kernels_fp8.CANDIDATE_TOL
    real = fm.fused_moe

    def skips_half(*a, out, **kw):                 # writes only half the rows: NaN stays
        real(*a, out=out, **kw)
        out[: out.shape[0] // 2] = float("nan")
    monkeypatch.setattr(fm, "fused_moe", skips_half)
    assert not kernels_fp8._check_vs_vllm(prob, base, ref) < kernels_fp8.CANDIDATE_TOL


def test_fp8_aligned_times_the_candidates_where_block_m_is_32():
    from moe_serve.bench.experts.problem import problem as _problem

    rows = kernels_fp8.part_fp8_aligned(SHAPE, (128,), 1, 2, "cpu", _problem, lambda *a: None)
    assert rows and all(r.get(f"ours_{t}_us", 0) > 0 and f"cfg_{t}" in r
                        for r in rows for t in ("swap", "swap_unfused", "bm64")), rows


def test_expert_bytes_count_weights_and_scales():
    N, K = 256, 7168
    assert kernels_fp8.expert_bytes(N, K, "bf16") == 3 * N * K * 2
    blocks = (2 * N // 128) * (K // 128) + (K // 128) * (N // 128)
    assert kernels_fp8.expert_bytes(N, K, kernels_fp8.BLOCK) == 3 * N * K + 4 * blocks
    assert kernels_fp8.expert_bytes(N, K, quant_format.PER_TOKEN) == 3 * N * K + 4 * (2 * N + K)
    assert kernels_fp8.expert_bytes(N, K, "fp8") == 3 * N * K + 8
    assert torch.tensor(kernels_fp8.FORMAT_MS).max() == 256
