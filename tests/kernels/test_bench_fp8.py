"""bench/kernels_fp8.py's parts on CPU (interpreter): the block-FP8 correctness part checks every
variant against the float64 references and fails rows it should; the forced aligned part times
both quantization variants; the floor's byte count includes the scales."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kernels_fp8  # noqa: E402

from kernels.moe import quant_format  # noqa: E402

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
    from kernels.moe import fused_moe as fm

    real = fm.fused_moe

    def wrong(*a, **kw):
        out = real(*a, **kw)
        out.mul_(1.5)
        return out
    monkeypatch.setattr(fm, "fused_moe", wrong)
    rows = kernels_fp8.part_block_correctness(SHAPE, (1,), "cpu", True, lambda *a: None)
    assert rows and not any(r["ok"] for r in rows)


def test_fp8_aligned_times_quantize_once_and_in_loop():
    from bench_kernels import _problem

    rows = kernels_fp8.part_fp8_aligned(SHAPE, (8,), 2, 3, "cpu", _problem, lambda *a: None)
    assert [r["dtype"] for r in rows] == ["fp8", quant_format.PER_TOKEN]
    assert all(r["ours_once_us"] > 0 and r["ours_inloop_us"] > 0 and "vllm_us" not in r
               for r in rows), rows


def test_expert_bytes_count_weights_and_scales():
    N, K = 256, 7168
    assert kernels_fp8.expert_bytes(N, K, "bf16") == 3 * N * K * 2
    blocks = (2 * N // 128) * (K // 128) + (K // 128) * (N // 128)
    assert kernels_fp8.expert_bytes(N, K, kernels_fp8.BLOCK) == 3 * N * K + 4 * blocks
    assert kernels_fp8.expert_bytes(N, K, quant_format.PER_TOKEN) == 3 * N * K + 4 * (2 * N + K)
    assert kernels_fp8.expert_bytes(N, K, "fp8") == 3 * N * K + 8
    assert torch.tensor(kernels_fp8.FORMAT_MS).max() == 256
