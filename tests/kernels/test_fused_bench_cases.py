"""The kernel-level benchmark cases (moe_serve.kernels.fused.bench_cases) on CPU (their dry run): each
pair's fused launch (under the interpreter) and unfused chain compute the same outputs, so a
timing harness compares like with like."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.fused import bench_cases


def test_norm_gemv_pair_computes_one_answer() -> None:
    pair = bench_cases.norm_gemv(N=24, K=128, M=3, dtype=torch.float32, write_h=True, device="cpu",
                                 compile_unfused=False, seed=torch.seed() % 2 ** 31)
    (y, res, h), (y_u, res_u, h_u), (y_f, res_f, h_f) = pair.fused(), pair.unfused(), pair.others["folded"]()
    assert torch.equal(res, res_u) and torch.equal(res_f, res_u) and torch.equal(h_f, h)
    assert rel_err(h, h_u) < 1e-6 and rel_err(y, y_u) < 1e-6 and rel_err(y_f, y_u) < 1e-6
    assert pair.bytes == 4 * (24 * 128 + 3 * 128 * 4 + 3 * 24 + 128)


def test_qk_norm_rope_pair_computes_one_answer() -> None:
    pair = bench_cases.qk_norm_rope(Hq=2, Hkv=1, D=32, M=4, rot_dim=16, neox=False, kv_cache=True,
                                    dtype=torch.float32, device="cpu", blocks=4, block_size=4,
                                    compile_unfused=False, seed=torch.seed() % 2 ** 31)
    assert "vllm_fused" not in pair.others                 # vLLM's CUDA ops are not built here
    out = pair.fused()
    q_u, k_u = pair.unfused()
    assert rel_err(out[:, :64], q_u) < 1e-6 and rel_err(out[:, 64:], k_u) < 1e-6


def test_qwen3_shapes_are_its_decode_layer() -> None:
    """The named shapes against bench/models/qwen3-30b-a3b/config.json."""
    cfg = json.loads((Path(__file__).resolve().parents[2] / "bench/models/qwen3-30b-a3b/config.json").read_text())
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    s = bench_cases.QWEN3_30B_A3B
    assert s["qkv"] == {"N": (hq + 2 * hkv) * d, "K": cfg["hidden_size"]}
    assert (s["gate"]["N"], s["gate"]["K"]) == (cfg["num_experts"], cfg["hidden_size"])
    assert s["qk"] == {"Hq": hq, "Hkv": hkv, "D": d}
