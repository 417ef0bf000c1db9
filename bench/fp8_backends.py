"""FP8 per-tensor MoE backends, kernel level, one run: FlashInfer's CUTLASS fused MoE (vLLM's
stock default for static per-tensor FP8 checkpoints on Hopper), vLLM's Triton `fused_experts`
(`moe_backend=triton`) and ours (as served: our kernel where routing says so), per shard and M.

    python bench/fp8_backends.py --out runs/fp8b            # H200: the tuned shapes, M=1..256
    python bench/fp8_backends.py --shapes Mixtral-8x7B/TP2,Qwen3-30B-A3B/TP1 --out runs/fp8b
    python bench/fp8_backends.py --shapes Mixtral-8x7B/TP8 --flush-l2 --out runs/fp8b  # + L2-cold
    TRITON_INTERPRET=1 python bench/fp8_backends.py --smoke --out /tmp/fp8b   # CPU: ours only

Every backend gets the same problem (kernels.tuning.timing.make_problem: per-expert weight scales,
static activation scales) and is timed the same way (CUDA-graph replay over rotating input
sets, median). FlashInfer is called the way vLLM's FlashInferExperts calls it: fp8 input from a
static quant of x, w13 in [w3; w1] order, quant_scales [w13_scale*a1, 1/a2, w2_scale*a2, a1];
the quant of x is inside its timed call, as it is in serving. FlashInfer's autotuner picks its
tactics first (as vLLM's warm-up does). Before timing, each backend's output at that M is
checked against the float64 reference (fp8 rounding of x and the SiLU output included):
||out - ref|| / ||ref|| goes into the row, NaN-poisoned outputs. Rows go to --out/fp8_backends.json
as they finish. A backend that is not importable is reported as absent, never as a number.
With --flush-l2 each backend is also timed with L2 flushed before every call (kernels.tuning.timing:
`<backend>_l2cold_us`, `served_l2cold_us`): the replayed calls share one set of weights, while in
serving each MoE layer reads its own, so at small M the warm-L2 time can flatter a backend.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels"), str(ROOT / "bench")]

from reference import moe_reference, rel_err  # noqa: E402
from shapes import SMOKE, TUNED, UNTUNED  # noqa: E402

from kernels.moe import routing, selection  # noqa: E402
from kernels.moe.fused_moe import fused_moe  # noqa: E402
from kernels.tuning.timing import make_problem, time_graph  # noqa: E402

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REF_TOKENS = 4            # float64 reference on the first tokens only (DeepSeek: 256 experts)


def log(msg: str) -> None:
    print(f"[fp8b {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flashinfer_moe() -> tuple[Callable, Callable] | None:
    """(cutlass_fused_moe, autotune) from FlashInfer, or None when it is not importable."""
    try:
        from flashinfer.autotuner import autotune
        from flashinfer.fused_moe import cutlass_fused_moe
    except ImportError as e:
        log(f"FlashInfer absent: {e}")
        return None
    return cutlass_fused_moe, autotune


def static_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to fp8 e4m3 by vLLM's static scaled_fp8_quant: the op vLLM's prepare
    step runs before FlashInfer (and fused_experts runs inside). Only called where FlashInfer
    runs, i.e. on the GPU beside vLLM; an error there propagates."""
    from vllm import _custom_ops as ops

    return ops.scaled_fp8_quant(x, scale)[0]


def flashinfer_weights(prob: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """FlashInfer's view of a problem's weights, made once per shape: w13 as [E, 2N, K] in
    (up, gate) order, and quant_scales [w13_scale*a1, 1/a2, w2_scale*a2, a1]."""
    w1, _, s1, s2 = prob["weights"]
    N = w1.shape[1] // 2
    w31 = torch.cat([w1[:, N:], w1[:, :N]], dim=1).contiguous()
    a1 = prob["fp8"].a1_scale.float().reshape(())
    a2 = prob["fp8"].a2_scale.float().reshape(())
    return w31, [(s1 * a1).float().contiguous(), (1.0 / a2).reshape(()),
                 (s2 * a2).float().contiguous(), a1]


def backends(prob: dict[str, Any], fi: tuple | None,
             fi_weights: tuple[torch.Tensor, list[torch.Tensor]] | None
             ) -> dict[str, Callable[[int, torch.Tensor], None]]:
    """name -> call(set index, out): each writes the layer output for input set i into out."""
    w1, w2, s1, s2 = prob["weights"]
    q = prob["fp8"]
    calls: dict[str, Callable[[int, torch.Tensor], None]] = {}

    def ours(i: int, out: torch.Tensor) -> None:
        x, tw, ids = prob["sets"][i]
        fused_moe(x, w1, w2, tw, ids, fp8=q, out=out)
    calls["ours"] = ours

    from kernels.moe import vllm_kernels
    fx = vllm_kernels.fused_experts() if torch.cuda.is_available() else None
    if fx is not None:
        fused_experts, qcfg = fx
        quant = qcfg(w1_scale=s1, w2_scale=s2, a1_scale=q.a1_scale, a2_scale=q.a2_scale)

        def vllm_triton(i: int, out: torch.Tensor) -> None:
            x, tw, ids = prob["sets"][i]
            out.copy_(fused_experts(x, w1, w2, tw, ids, quant_config=quant))
        calls["vllm_triton"] = vllm_triton

    if fi is not None and fi_weights is not None:
        cutlass_fused_moe, _ = fi
        w31, scales = fi_weights

        def flashinfer_cutlass(i: int, out: torch.Tensor) -> None:
            x, tw, ids = prob["sets"][i]
            cutlass_fused_moe(static_quant(x, scales[3]), ids, tw, w31, w2, torch.bfloat16,
                              scales, output=out)
        calls["flashinfer_cutlass"] = flashinfer_cutlass
    return calls


def check(prob: dict[str, Any], call: Callable[[int, torch.Tensor], None]) -> float:
    """Relative error of set 0's first REF_TOKENS tokens against the float64 reference."""
    w1, w2, s1, s2 = prob["weights"]
    x, tw, ids = prob["sets"][0]
    out = torch.full_like(x, float("nan"))
    call(0, out)
    n = min(REF_TOKENS, x.shape[0])
    ref = moe_reference(x[:n], w1, w2, tw[:n], ids[:n], w1_scale=s1, w2_scale=s2,
                        a1_scale=prob["fp8"].a1_scale, a2_scale=prob["fp8"].a2_scale,
                        quant_acts="static")
    return rel_err(out[:n], ref)


def run_shape(name: str, shape: tuple, ms: tuple, fi: tuple | None, n_sets: int,
              replays: int, flush_l2: bool = False) -> list[dict[str, Any]]:
    E, N, K, topk = shape
    rows, weights, fi_weights = [], None, None
    for M in ms:
        prob = make_problem(E, N, K, topk, M, "fp8", n_sets, "cuda" if torch.cuda.is_available()
                            else "cpu", seed=M, weights=weights)
        weights = prob["weights"]
        if fi is not None and fi_weights is None:     # weights and scales are shared by all M
            fi_weights = flashinfer_weights(prob)
        row: dict[str, Any] = {"shape": name, "E": E, "N": N, "K": K, "topk": topk, "M": M,
                               "route": selection.route(E, N, K, "fp8", M, topk=topk)}
        outs = [torch.empty_like(x) for x, _, _ in prob["sets"]]
        for bname, call in backends(prob, fi, fi_weights).items():
            try:
                if bname == "flashinfer_cutlass":
                    with fi[1](True):            # FlashInfer autotune: tactics per M bucket
                        call(0, outs[0])
                row[f"{bname}_err"] = check(prob, call)
                row[f"{bname}_us"] = time_graph(lambda i, c=call: c(i, outs[i]), n_sets, replays)
                if flush_l2:
                    row[f"{bname}_l2cold_us"] = time_graph(lambda i, c=call: c(i, outs[i]), n_sets,
                                                           replays, flush_l2=True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row[f"{bname}_error"] = f"{type(e).__name__}: {e}"[:300]
        for t in ("_us", "_l2cold_us"):
            if "ours" + t in row and "vllm_triton" + t in row:
                row["served" + t] = row[("ours" if row["route"] == routing.OURS else "vllm_triton") + t]
        rows.append(row)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, M<=4 (CPU interpreter)")
    ap.add_argument("--shapes", default=None,
                    help="comma list of names from bench/shapes.py (default: the tuned shapes)")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--n-sets", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--flush-l2", action="store_true",
                    help="also time every backend with L2 flushed before each call (GPU only)")
    args = ap.parse_args(argv)
    if args.flush_l2 and not torch.cuda.is_available():
        ap.error("--flush-l2 needs a CUDA device")
    shapes = SMOKE if args.smoke else TUNED
    if args.shapes:
        known = {**TUNED, **UNTUNED, **SMOKE}
        unknown = [n for n in args.shapes.split(",") if n not in known]
        if unknown:
            ap.error(f"unknown shapes {unknown}; known: {sorted(known)}")
        shapes = {n: known[n] for n in args.shapes.split(",")}
    ms = (1, 4) if args.smoke else tuple(int(m) for m in args.ms.split(","))
    fi = flashinfer_moe() if torch.cuda.is_available() else None
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "flashinfer": _version("flashinfer"), "vllm": _version("vllm"),
            "torch": torch.__version__, "flush_l2": args.flush_l2}
    rows: list[dict[str, Any]] = []
    for name, shape in shapes.items():
        rows += run_shape(name, shape, ms, fi, 2 if args.smoke else args.n_sets,
                          3 if args.smoke else args.replays, args.flush_l2)
        (args.out / "fp8_backends.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    log(f"wrote {args.out / 'fp8_backends.json'} ({len(rows)} rows)")
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001  (absent, or fails to import without a GPU)
        return None


if __name__ == "__main__":
    sys.exit(main())
