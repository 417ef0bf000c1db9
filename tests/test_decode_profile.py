"""bench/decode_profile.py: trace summaries (kernel totals, busy time as the union of overlapping
kernels) and the per-decode-step split from a short and a long trace."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_profile  # noqa: E402


def _trace(path: Path, kernels: list[tuple[str, float, float]]) -> Path:
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1e6},
               {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5.0}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_summary_counts_gpu_kernels_and_unions_overlaps(tmp_path):
    # moe_gemm_kernel [0, 10) overlaps fused_moe_kernel [5, 20) (PDL); a gap, then [30, 34)
    t = _trace(tmp_path / "a.pt.trace.json.gz", [("moe_gemm_kernel", 0, 10), ("fused_moe_kernel", 5, 15),
                                                 ("rms_norm_kernel", 30, 4)])
    s = decode_profile.summarize_trace(t)
    assert s["kernels"] == {"moe_gemm_kernel": [1, 10.0], "fused_moe_kernel": [1, 15.0],
                            "rms_norm_kernel": [1, 4.0]}
    assert s["busy_us"] == pytest.approx(24.0) and s["span_us"] == pytest.approx(34.0)


def test_per_step_takes_long_minus_short_over_the_extra_tokens(tmp_path):
    def summary(steps: int) -> dict:
        # a prefill of 1000 us, then per step one MoE kernel of 30 us and one other of 20 us
        ks = [("prefill_gemm", 0.0, 1000.0)]
        for i in range(steps):
            t0 = 2000.0 + 100.0 * i
            ks += [("moe_decode_up_kernel", t0, 30.0), ("flash_attn_fwd", t0 + 40, 20.0)]
        return decode_profile.summarize_trace(_trace(tmp_path / f"{steps}.json.gz", ks))

    prof = {"tokens": [4, 12], "short": summary(4), "long": summary(12)}
    step = decode_profile.per_step(prof, step_ms=0.1)
    assert step["busy_ms"] == pytest.approx(0.05) and step["moe_ms"] == pytest.approx(0.03)
    assert step["other_ms"] == pytest.approx(0.02) and step["gpu_wait_ms"] == pytest.approx(0.05)


@pytest.mark.parametrize("name,moe", [("moe_gemm_kernel", True), ("fused_moe_kernel", True),
                                      ("topkGatingSoftmax", True), ("moe_align_block_size_kernel", True),
                                      ("void cutlass_kernels::MoeFCGemm<...>", True),
                                      ("void tensorrt_llm::kernels::cutlass_kernels::doActivationKernel<...>", True),
                                      ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17"
                                       "GroupProblemShapeIN4cute5tupleIJlllEEEEENS1_10", True),
                                      ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<...>", False),
                                      ("void vllm::act_and_mul_kernel<...>", False),
                                      ("flash_fwd_kernel", False), ("rms_norm_kernel", False)])
def test_moe_kernel_names(name, moe):
    assert bool(decode_profile.MOE_KERNELS.search(name)) is moe


def test_table_rows_for_profiled_runs_only(tmp_path, capsys):
    ks = lambda n: [("moe_gemm_kernel", 100.0 * i, 30.0) for i in range(n)]  # noqa: E731
    prof = {"tokens": [2, 6], "short": decode_profile.summarize_trace(_trace(tmp_path / "s.json.gz", ks(2))),
            "long": decode_profile.summarize_trace(_trace(tmp_path / "l.json.gz", ks(6)))}
    rows = [{"B": 1, "step_ms": 0.1, "tok_s": 1e4}]
    for name, extra in (("run-r0-stock.json", {"profile": {"1": prof}}), ("run-r1-stock.json", {})):
        (tmp_path / name).write_text(json.dumps({"variant": "stock", "round": int(name[5]), "rows": rows, **extra}))
    assert decode_profile.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["| stock | 0 | 1 | 0.100 | 0.030 | 0.030 | 0.000 | 0.070 | 30 % |"]
