"""Kernel benchmark: our Triton fused MoE vs vLLM's fused_experts on the H200 (one script).

    python bench/bench_kernels.py --correctness --sass --compiles --out $OUT
    python bench/bench_kernels.py --bench --untuned --out $OUT   (ours, vLLM, floor)
    (tuning: `moe-serve tune --model DIR`, kernels/tuning/tune_cli.py)
    python bench/bench_kernels.py --quick-bench --out $OUT     (M in 1,4,16,64,256 only)
    python bench/bench_kernels.py --decode-split --shapes ... --ms 1,2,4 --out $OUT
        (the decode path's default config with and without split-K, vs vLLM)
    python bench/bench_kernels.py --fp8-formats --out $OUT
        (block FP8 and per-token FP8: correctness vs float64 and vLLM's block kernel, ours vs
        vLLM vs the floor on bench/kernels_fp8.FORMAT_SHAPES; the per-tensor and per-token
        aligned path forced vs vLLM at M 8..256; each also alone: --block-correctness,
        --format-bench, --fp8-aligned)
    TRITON_INTERPRET=1 python bench/bench_kernels.py --smoke --out /tmp/smoke   (CPU)
Each part is isolated (a failure prints its traceback and the others go on); results go to
--out as results.json + results.md; a short table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "kernels")]

import torch  # noqa: E402

import kernels_fp8  # noqa: E402
from shapes import M_LIST, QUICK_MS, SMOKE, TUNED, UNTUNED  # noqa: E402

from kernels.moe import quant_format  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
RESULTS: dict[str, Any] = {}
_OUT: Path | None = None


def log(*a: Any) -> None:
    print(*a, flush=True)


def copy_ceiling() -> dict[str, Any]:
    """Device copy bandwidth in bytes/s, counting bytes read + written (2 x buffer size).

    The 2026-11-29 run timed `b.copy_(a)` (uint8, 1 GiB) replayed from a CUDA graph and got
    2.70e12 B/s where an SM copy reaches ~4.3e12: a same-dtype contiguous copy_ is a
    cudaMemcpyAsync D2D, which a graph turns into a memcpy node that the driver may run on a
    copy engine (DMA, ~2.7 TB/s on H200), not on the SMs our kernels use; the fractions of
    that ceiling then exceeded 1. Now: 1 GiB fp32 buffers, warm-up, CUDA events around 20
    back-to-back eager calls (each ~0.5 ms, so launch gaps are negligible), for an SM copy
    kernel (torch.mul(a, 1, out=b): one read, one write per element), the eager memcpy and
    the graph-replayed memcpy; the ceiling is the best of them, all are reported."""
    if not CUDA:
        return {"copy_bytes_per_s": float("nan")}
    from kernels.tuning.timing import time_graph

    n = 1 << 28                                   # 256 Mi fp32 = 1 GiB per buffer
    a = torch.rand(n, device=DEV)
    b = torch.empty_like(a)
    moved = 2 * a.numel() * a.element_size()

    def eager(fn, iters: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) * 1e3 / iters    # us per call

    res = {"sm_copy_kernel": moved / (eager(lambda: torch.mul(a, 1.0, out=b)) * 1e-6),
           "memcpy_eager": moved / (eager(lambda: b.copy_(a)) * 1e-6),
           "memcpy_graph": moved / (time_graph(lambda i: b.copy_(a), 1, replays=10) * 1e-6)}
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": max(res.values()), "buffer_bytes": moved // 2, **res}


def _problem(shape, M, dtype, n_sets, weights=None):
    from kernels.tuning.timing import make_problem

    E, N, K, topk = shape
    return make_problem(E, N, K, topk, M, dtype, n_sets, DEV, seed=M, weights=weights)


# ----------------------------------------------------------------------------------------
def part_correctness(shapes: dict, ms: tuple, smoke: bool) -> list[dict]:
    """Every path (aligned: plain, swapped, split, x quantized once; decode: heuristic, swapped,
    narrow) in bf16 and fp8 W8A8 against the float64 reference, into NaN-poisoned outputs."""
    from kernels.moe import configs, smem
    from reference import quant_fp8

    rows = []
    fdt = torch.float16 if smoke else torch.bfloat16  # interpreter: bf16 tl.dot is garbage
    for name, (E, N, K, topk) in shapes.items():
        g = torch.Generator(device=DEV).manual_seed(1)
        w1 = torch.randn(E, 2 * N, K, device=DEV, generator=g) * K ** -0.5
        w2 = torch.randn(E, K, N, device=DEV, generator=g) * N ** -0.5
        q = {pc: (quant_fp8(w1, pc), quant_fp8(w2, pc)) for pc in (False, True)}
        for M in ms:
            x = torch.randn(M, K, device=DEV, generator=g).to(fdt)
            tw, ids = torch.softmax(torch.randn(M, E, device=DEV, generator=g), -1).topk(topk)
            ids = ids.to(torch.int32)
            base = configs.aligned_default(M, E, N, K, topk, "bf16")  # aligned variants
            for swap in (False, True, "split", "prequant", "decode", "decode-swap", "decode-narrow",
                         "decode-split"):
                if str(swap).startswith("decode"):
                    if M * topk > 128:
                        continue
                    cfg = smem.fit(_decode_variant(M, E, N, K, topk, str(swap)), "bf16",
                                   topk=topk)         # forced variants must fit 227 KB too
                    rows += _check_variants(name, M, swap, cfg, x, w1, w2, q, tw, ids, fdt,
                                            smoke, E)
                    continue
                sw = swap is True
                cfg = {**base, "SWAP_AB": sw, "BLOCK_M": 16 if sw else base["BLOCK_M"],
                       "BLOCK_N": max(64, base["BLOCK_N"]) if sw else base["BLOCK_N"],
                       "SPLIT_K": 1, "FUSE_GU": True}
                cfg["DOWN"] = {**base["DOWN"], "SWAP_AB": sw, "SPLIT_K": 1,
                               "BLOCK_N": max(64, base["DOWN"]["BLOCK_N"]) if sw else
                               base["DOWN"]["BLOCK_N"]}
                if swap == "split":   # un-fused gate/up + split-K in both GEMMs (fp32 atomics)
                    cfg.update(SPLIT_K=2, FUSE_GU=False, BLOCK_N=64)
                    cfg["DOWN"]["SPLIT_K"] = 2
                if swap == "prequant":  # A_PREQUANT acts only with a static activation scale
                    cfg["A_PREQUANT"] = True
                cfg = smem.fit(configs.validate(cfg), "bf16")  # bf16 needs more smem than fp8
                rows += _check_variants(name, M, swap, cfg, x, w1, w2, q, tw, ids, fdt, smoke, E,
                                        static_only=swap == "prequant")
        del w1, w2, q
    return rows


def _decode_variant(M: int, E: int, N: int, K: int, topk: int, kind: str) -> dict:
    """The decode heuristic's config, forced to swapped 64-row tiles ('decode-swap') or to
    16-row mma.sync tiles with BLOCK_K 64 and no PDL ('decode-narrow'), or split-K in both
    kernels ('decode-split': the heuristic's splits, at least 2 each)."""
    from kernels.moe import heuristics
    from kernels.moe.config_schema import validate

    cfg = heuristics.decode_config(M, E, N, K, topk, "bf16", split=kind == "decode-split")
    if kind == "decode-split":
        cfg = {**cfg, "SPLIT_K": max(2, cfg["SPLIT_K"]),
               "DOWN": {**cfg["DOWN"], "SPLIT_K": max(2, cfg["DOWN"]["SPLIT_K"])}}
    if kind == "decode-swap":
        cfg = {**cfg, "SWAP_AB": True, "BLOCK_N": 64,
               "DOWN": {**cfg["DOWN"], "SWAP_AB": True, "BLOCK_N": 64}}
    elif kind == "decode-narrow":
        cfg = {**cfg, "SWAP_AB": False, "BLOCK_N": 16, "BLOCK_K": 64, "PDL": False,
               "DOWN": {**cfg["DOWN"], "SWAP_AB": False, "BLOCK_N": 16, "BLOCK_K": 64}}
    return validate(cfg)


def _check_variants(name, M, swap, cfg, x, w1, w2, q, tw, ids, fdt, smoke, E,  # noqa: PLR0913
                    static_only: bool = False) -> list[dict]:
    """bf16 (fp16 under the interpreter) and the four fp8 W8A8 variants of one config (only the
    two with static activation scales when static_only)."""
    from kernels.moe.fused_moe import Fp8Scales, fused_moe
    from reference import act_amax, moe_reference, rel_err

    rows = []
    variants = [("bf16" if not smoke else "fp16", None)]
    for pc in (False, True):
        for static in (False, True):
            variants.append((f"fp8-{'chan' if pc else 'tensor'}-"
                             f"{'static' if static else 'dyn'}", (pc, static)))
    if static_only:
        variants = [(v, spec) for v, spec in variants if spec is not None and spec[1]]
    M, K = x.shape
    for vname, spec in variants:
        out = torch.full((M, K), float("nan"), dtype=fdt if spec is None or fdt == torch.float16
                         else torch.bfloat16, device=DEV)
        try:
            if spec is None:
                ww1, ww2 = w1.to(fdt), w2.to(fdt)
                fused_moe(x, ww1, ww2, tw, ids, out=out, config=cfg)
                ref = moe_reference(x, ww1, ww2, tw, ids)
                tol = 2e-2
            else:
                pc, static = spec
                (q1, s1), (q2, s2) = q[pc]
                a1 = (x.float().abs().max() / 448).reshape(()) if static else None
                a2 = None
                if static:
                    deq = q1.float() * s1.reshape(E, -1, 1)
                    a2 = (act_amax(x.float(), deq, ids) / 448).float().reshape(())
                fused_moe(x, q1, q2, tw, ids, fp8=Fp8Scales(s1, s2, a1, a2), out=out,
                          config=cfg)
                ref = moe_reference(x, q1, q2, tw, ids, s1, s2)
                tol = 0.12
            err = rel_err(out, ref)
            ok = err < tol
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err, ok = float("nan"), False
            vname += f" ({type(e).__name__})"
        rows.append(dict(shape=name, M=M, swap=swap, variant=vname, rel_err=err,
                         ok=ok))
        log(f"[correctness] {name} M={M} swap={swap} {vname}: {err:.2e} "
            f"{'PASS' if ok else 'FAIL'}")
    return rows


# ----------------------------------------------------------------------------------------
def part_sass(out_dir: Path) -> list[dict]:
    """Compile swapped / unswapped small-M bf16 and fp8 variants for sm_90; grep the SASS."""
    from kernels.moe import aot
    from kernels.moe.fused_moe import Fp8Scales, fused_moe
    from kernels.moe.launch import record_launches

    rows = []
    E, N, K, topk = TUNED["Mixtral-8x7B/TP8"]
    M = 4
    for dt in ("bf16", "fp8"):
        for swap in (False, True, "split"):
            cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                       num_stages=4, SWAP_AB=bool(swap))
            if swap == "split":
                cfg.update(SPLIT_K=4, FUSE_GU=False,
                           DOWN=dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_stages=3))
            wdt = torch.bfloat16 if dt == "bf16" else torch.float8_e4m3fn
            x = torch.empty(M, K, dtype=torch.bfloat16)
            w1, w2 = torch.empty(E, 2 * N, K, dtype=wdt), torch.empty(E, K, N, dtype=wdt)
            tw, ids = torch.empty(M, topk), torch.zeros(M, topk, dtype=torch.int32)
            fp8 = Fp8Scales(torch.ones(E), torch.ones(E), torch.ones(()), None) \
                if dt == "fp8" else None
            with record_launches() as launches:
                fused_moe(x, w1, w2, tw, ids, fp8=fp8, config=cfg)
            for i, (name, ck) in enumerate(aot.compile_launches(launches, cache={})):
                if name != "moe_gemm_kernel":
                    continue
                text = aot.sass(ck)
                gemm = "gemm1" if i == 1 else "gemm2"
                (out_dir / f"sass_{dt}_{'swap' if swap else 'noswap'}_{gemm}.sass").write_text(text)
                kind = aot.mma_kind(text)
                expect = ("QGMMA" if dt == "fp8" else "HGMMA") if swap else "HMMA"
                atom = "RED" in text or "ATOM" in text
                ok = kind == expect and (atom == (swap == "split"))
                rows.append(dict(dtype=dt, swap=swap, gemm=gemm, mma=kind, atomics=atom,
                                 smem=int(ck.metadata.shared), ok=ok))
                log(f"[sass] {dt} swap={swap} {gemm}: {kind} (expected {expect}) "
                    f"atomics={atom} smem={ck.metadata.shared}")
    return rows


def part_sass_subprocess(out_dir: Path) -> list[dict]:
    """--sass under the interpreter: re-run this script with TRITON_INTERPRET=0 (compile only)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    sub = out_dir / "sass"
    sub.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, __file__, "--sass", "--out", str(sub)], env=env,
                       capture_output=True, text=True, timeout=600)
    log(r.stdout[-3000:], r.stderr[-2000:] if r.returncode else "")
    return json.loads((sub / "results.json").read_text()).get("sass", [])


# ----------------------------------------------------------------------------------------
def part_bench(shapes: dict, ms: tuple, dtypes: tuple, ceiling: float, n_sets: int,
               replays: int, tag: str) -> list[dict]:
    """Ours (the config serving would use: tuned table or default), vLLM's fused_experts and
    the streaming floor of the same expert bytes, per (shape, dtype, M), in one run."""
    from floor import floor_us
    from kernels_fp8 import expert_bytes

    from kernels.moe import configs, selection
    from kernels.tuning import precompile
    from kernels.moe.config_schema import label
    from kernels.moe.fused_moe import num_programs
    from kernels.tuning.timing import time_ours, time_vllm

    rows = []
    floors: dict[int, float] = {}
    if CUDA:  # compile every config this part will hit on the host CPU, in parallel
        precompile.precompile([(*shape, dt, M, selection.get_config(M, *shape, dt))
                               for shape in shapes.values() for dt in dtypes for M in ms], log=log)
    for name, shape in shapes.items():
        E, N, K, topk = shape
        for dt in dtypes:
            weights = None
            tuned = configs.load_table(E, N, K, dt, configs.device_name()) is not None
            for M in ms:
                row = dict(part=tag, shape=name, dtype=dt, M=M, tuned=tuned)
                cfg = selection.get_config(M, E, N, K, topk, dt)
                row["cfg"] = label(cfg)
                row["ctas"] = "%d/%d" % num_programs(M, E, N, K, topk, cfg)
                row["route"] = selection.route(E, N, K, dt, M, topk=topk)  # what serving uses
                try:
                    prob = _problem(shape, M, dt, n_sets, weights)
                    weights = prob["weights"]
                    ebytes = expert_bytes(N, K, dt)          # fp8: weights + their scales
                    hit = sum(len(torch.unique(ids)) for _, _, ids in prob["sets"]) / n_sets
                    row["ours_us"] = time_ours(prob, None, replays)
                    row["gbytes_hit"] = hit * ebytes / 1e9
                    row["ours_bw_frac"] = hit * ebytes / (row["ours_us"] * 1e-6) / ceiling
                    if CUDA:
                        nb = int(hit * ebytes)
                        key = round(nb, -5)                  # floors within 100 kB shared
                        if key not in floors:
                            floors[key] = floor_us(nb, replays)["floor_us"]
                        row["floor_us"] = floors[key]
                        row["ours_vs_floor"] = row["ours_us"] / row["floor_us"]
                    try:
                        vl = time_vllm(prob, replays) if CUDA else None
                    except Exception as e:  # noqa: BLE001
                        vl = None
                        row["vllm_error"] = f"{type(e).__name__}: {e}"[:200]
                    if vl is not None:
                        row["vllm_us"] = vl
                        row["speedup"] = vl / row["ours_us"]
                        row["served_speedup"] = row["speedup"] if row["route"] == "ours" else 1.0
                        row["vllm_bw_frac"] = hit * ebytes / (vl * 1e-6) / ceiling
                        if "floor_us" in row:
                            row["vllm_vs_floor"] = vl / row["floor_us"]
                    del prob
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                log(f"[{tag}] " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k != "part"))
            del weights
            if CUDA:
                torch.cuda.empty_cache()
            RESULTS[tag] = rows                   # partial results survive a time-out kill
            if _OUT is not None:
                _save(_OUT)
    return rows


def part_decode_split(shapes: dict, ms: tuple, dtypes: tuple, n_sets: int,
                      replays: int) -> list[dict]:
    """The decode path's default config without and with split-K (heuristics.decode_split) and
    vLLM's fused_experts, per (shape, dtype, M) in one run: whether split-K should be the
    default for untuned shapes."""
    from kernels.moe import heuristics
    from kernels.tuning import precompile
    from kernels.moe.config_schema import label
    from kernels.tuning.timing import time_ours, time_vllm

    rows = []
    cfgs = {(name, dt, M, sp): heuristics.decode_config(M, *shape, dt, split=sp)
            for name, shape in shapes.items() for dt in dtypes for M in ms for sp in (False, True)
            if M * shape[3] <= heuristics.DECODE_MAX_SLOTS}
    if CUDA:
        precompile.precompile([(*shapes[n], dt, M, c) for (n, dt, M, _), c in cfgs.items()], log=log)
    for name, shape in shapes.items():
        for dt in dtypes:
            weights = None
            for M in ms:
                if (name, dt, M, False) not in cfgs:
                    continue
                row = dict(part="decode-split", shape=name, dtype=dt, M=M)
                try:
                    prob = _problem(shape, M, dt, n_sets, weights)
                    weights = prob["weights"]
                    for sp, tag in ((False, "plain"), (True, "split")):
                        cfg = cfgs[(name, dt, M, sp)]
                        row[f"{tag}_cfg"] = label(cfg)
                        row[f"{tag}_us"] = time_ours(prob, cfg, replays)
                    row["split_gain"] = row["plain_us"] / row["split_us"]
                    if CUDA:
                        row["vllm_us"] = time_vllm(prob, replays)
                        row["split_vs_vllm"] = row["vllm_us"] / row["split_us"]
                        row["plain_vs_vllm"] = row["vllm_us"] / row["plain_us"]
                    del prob
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                log("[decode-split] " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else
                                                 f"{k}={v}" for k, v in row.items() if k != "part"))
                RESULTS["decode-split"] = rows
                if _OUT is not None:
                    _save(_OUT)
            del weights
    return rows


def part_compiles(shape: tuple, dtype: str, max_m: int) -> dict:
    """Compiles (jit_monitor) while M sweeps 1..max_m after warm-up, ours and vLLM's."""
    from kernels.plugin import jit_monitor
    from kernels.moe.fused_moe import fused_moe
    from kernels.moe.moe_variants import warm_moe_variants

    E, N, K, topk = shape
    jit_monitor.install()
    res: dict[str, Any] = {"shape": shape, "dtype": dtype, "max_m": max_m,
                           "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    prob = _problem(shape, max_m, dtype, 1)
    x, tw, ids = prob["sets"][0]
    w1, w2 = prob["weights"][:2]
    jit_monitor.set_phase("warmup")
    res["ours_variants"] = warm_moe_variants(E, N, K, topk, torch.bfloat16, max_m, "per_tensor" if dtype == "fp8"
                                  else None, DEV, static_act=True, verbose=False)
    before = jit_monitor.snapshot()
    jit_monitor.set_phase("serving")
    for m in range(1, max_m + 1):
        fused_moe(x[:m], w1, w2, tw[:m], ids[:m], fp8=prob["fp8"])
    snap = jit_monitor.snapshot()
    res["ours_serving_compiles"] = sum(v for (k, ph, kd), v in snap.items()
                                       if ph == "serving" and kd == "compile")
    res["ours_warmup_compiles"] = sum(v for (k, ph, kd), v in before.items() if kd == "compile")
    from kernels.moe import vllm_kernels

    vl = vllm_kernels.fused_experts() if CUDA else None
    if vl is not None:
        fused_experts, qcfg = vl
        quant = None
        if prob["fp8"] is not None:
            quant = qcfg(w1_scale=prob["weights"][2], w2_scale=prob["weights"][3],
                         a1_scale=prob["fp8"].a1_scale, a2_scale=prob["fp8"].a2_scale)
        jit_monitor.set_phase("vllm_warmup")
        m = 1
        while m <= max_m:
            fused_experts(x[:m], w1, w2, tw[:m], ids[:m], quant_config=quant)
            m *= 2
        jit_monitor.set_phase("vllm_serving")
        for m in range(1, max_m + 1):
            fused_experts(x[:m], w1, w2, tw[:m], ids[:m], quant_config=quant)
        snap = jit_monitor.snapshot()
        res["vllm_serving_compiles"] = sum(v for (k, ph, kd), v in snap.items()
                                           if ph == "vllm_serving" and kd == "compile")
        res["vllm_serving_by_kernel"] = {k: v for (k, ph, kd), v in snap.items()
                                         if ph == "vllm_serving" and kd == "compile"}
    jit_monitor.set_phase("warmup")
    log(f"[compiles] {res}")
    return res


# ----------------------------------------------------------------------------------------
def _md_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    md = [f"# bench_kernels ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"{torch.cuda.get_device_name() if CUDA else 'cpu'})"]
    for k, v in RESULTS.items():
        md.append(f"\n## {k}\n")
        md.append(_md_table(v) if isinstance(v, list) else f"```\n{json.dumps(v, default=str)}\n```")
    (out / "results.md").write_text("\n".join(md) + "\n")


def _run(name: str, fn, *a, **kw) -> None:
    t0 = time.perf_counter()
    log(f"==== {name} ====")
    try:
        RESULTS[name] = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001  one failing part must not kill the others
        traceback.print_exc()
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
    log(f"==== {name} done in {time.perf_counter() - t0:.1f}s ====")
    if _OUT is not None:
        try:  # partial results survive a timeout kill of a later part
            _save(_OUT)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def _summary() -> None:
    log("\n===== summary =====")
    for r in RESULTS.get("correctness", []) if isinstance(RESULTS.get("correctness"), list) else []:
        if not r["ok"]:
            log(f"FAIL correctness {r}")
    corr = RESULTS.get("correctness")
    if isinstance(corr, list):
        log(f"correctness: {sum(r['ok'] for r in corr)}/{len(corr)} PASS, "
            f"max err {max((r['rel_err'] for r in corr), default=0):.2e}")
    if isinstance(RESULTS.get("sass"), list):
        for r in RESULTS["sass"]:
            log(f"sass {r['dtype']} swap={r['swap']} {r['gemm']}: {r['mma']} "
                f"{'OK' if r['ok'] else 'UNEXPECTED'}")
    for part in ("bench", "quick-bench", "untuned", "format-bench"):
        rows = RESULTS.get(part)
        if isinstance(rows, list):
            _bench_summary(part, rows)
    if "compiles" in RESULTS:
        log(f"compiles: {RESULTS['compiles']}")
    kernels_fp8.summary(RESULTS, log)


def _bench_summary(part: str, rows: list[dict]) -> None:
    """Per cell: ours, vLLM, floor, ratios, route; then per (shape, dtype) geomeans at M <= 64
    against the targets, and the served minimum (vLLM's kernel where routed to vLLM)."""
    nan = float("nan")
    log(f"{part}: shape dtype M | ours_us vllm_us floor_us | speedup ours/floor vllm/floor | "
        f"route served | cfg")
    for r in rows:
        log(f"  {r['shape']:22s} {r['dtype']:4s} {r['M']:5d} | {r.get('ours_us', nan):8.1f} "
            f"{r.get('vllm_us', nan):8.1f} {r.get('floor_us', nan):8.1f} | "
            f"{r.get('speedup', nan):5.2f} {r.get('ours_vs_floor', nan):5.2f} "
            f"{r.get('vllm_vs_floor', nan):5.2f} | {r.get('route', ''):4s} "
            f"{r.get('served_speedup', nan):5.2f} | {r.get('cfg', '')}"
            f"{'  ERROR ' + r['error'] if 'error' in r else ''}")
    groups: dict = {}
    for r in rows:
        if "speedup" in r:
            groups.setdefault((r["shape"], r["dtype"], r.get("tuned", False)), []).append(r)
    for (shp, dt, tuned), rs in groups.items():
        sp = [r["speedup"] for r in rs if r["M"] <= 64]
        if not sp:
            continue
        gm = float(torch.tensor(sp).log().mean().exp())
        target = (1.5 if dt == "fp8" else 1.1) if tuned else 1.0
        served = min(r["served_speedup"] for r in rs)
        log(f"  geomean M<=64 {shp:22s} {dt:4s} {'tuned' if tuned else 'default'} {gm:5.2f}x "
            f"(target {target}x) min {min(sp):.2f}x; served min over all M {served:.2f}x "
            f"{'OK' if gm >= target and served >= 0.98 else 'SHORT'}")
    for r in rows:
        if r.get("served_speedup", 1.0) < 0.98:
            log(f"  served < 0.98x: {r['shape']} {r['dtype']} M={r['M']} {r['served_speedup']:.2f}x")


def _fp8_formats(args: argparse.Namespace, ms: tuple | None) -> None:
    """--fp8-formats (or its parts): bench/kernels_fp8's block correctness, the format bench
    (block and per-token FP8 on FORMAT_SHAPES) and the forced aligned path."""
    every = args.fp8_formats
    shapes = {k: v for k, v in kernels_fp8.FORMAT_SHAPES.items()
              if not args.shapes or k in args.shapes.split(",")}
    if every or args.format_bench:
        if "ceiling" not in RESULTS:
            _run("ceiling", copy_ceiling)
    ceiling = (RESULTS.get("ceiling") or {}).get("copy_bytes_per_s", float("nan"))
    if every or args.block_correctness:
        _run("block-correctness", kernels_fp8.part_block_correctness, shapes, ms or (1, 7, 33),
             DEV, False, log)
    if every or args.format_bench:
        _run("format-bench", part_bench, shapes, ms or kernels_fp8.FORMAT_MS,
             (kernels_fp8.BLOCK, quant_format.PER_TOKEN), ceiling, args.sets, args.replays,
             "format-bench")
    if every or args.fp8_aligned:
        aligned = {k: v for k, v in {**UNTUNED, **kernels_fp8.FORMAT_SHAPES}.items()
                   if k in (args.shapes.split(",") if args.shapes else
                            ("Mixtral-8x22B/TP8", "OLMoE", "Phi-3.5-MoE/TP8", "Qwen3-235B-A22B/TP8"))}
        _run("fp8-aligned", kernels_fp8.part_fp8_aligned, aligned, ms or kernels_fp8.ALIGNED_MS,
             args.sets, args.replays, DEV, _problem, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for part in ("correctness", "sass", "bench", "compiles", "untuned", "smoke",
                 "quick-bench", "decode-split", "fp8-formats", "block-correctness",
                 "format-bench", "fp8-aligned"):
        ap.add_argument(f"--{part}", action="store_true")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--shapes", default=None, help="comma list of names from bench/shapes.py")
    ap.add_argument("--ms", default=None, help="M list for --bench and --correctness (default 1,7,33)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--sets", type=int, default=8, help="input sets rotated per graph")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    global _OUT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _OUT = out
    dtypes = tuple(args.dtypes.split(","))
    shapes = TUNED if not args.shapes else {k: v for k, v in {**TUNED, **UNTUNED}.items()
                                             if k in args.shapes.split(",")}
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else M_LIST
    t0 = time.perf_counter()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1" and not CUDA:
            log("--smoke on CPU needs TRITON_INTERPRET=1")
            return 2
        _run("correctness", part_correctness, SMOKE, (1, 5), smoke=True)
        _run("sass", part_sass_subprocess, out)
        _run("bench", part_bench, SMOKE, (1, 4), dtypes, float("nan"), 2, 3, "bench")
        _run("quick-bench", part_bench, {"tiny-a": SMOKE["tiny-a"]}, (1,), ("fp8",),
             float("nan"), 2, 3, "quick-bench")
        _run("compiles", part_compiles, SMOKE["tiny-a"], "fp8", 12)
        _run("untuned", part_bench, {"tiny-b": SMOKE["tiny-b"]}, (2,), ("bf16",), float("nan"),
             2, 3, "untuned")
        _run("decode-split", part_decode_split, {"tiny-b": SMOKE["tiny-b"]}, (1,), ("bf16",), 2, 3)
        _run("block-correctness", kernels_fp8.part_block_correctness, {"tiny-a": SMOKE["tiny-a"]},
             (1, 9), DEV, True, log)
        _run("format-bench", part_bench, {"tiny-a": SMOKE["tiny-a"]}, (1, 8),
             (quant_format.block_key(32, 32), quant_format.PER_TOKEN), float("nan"), 2, 3,
             "format-bench")
        _run("fp8-aligned", kernels_fp8.part_fp8_aligned, {"tiny-a": SMOKE["tiny-a"]}, (8,), 2, 3,
             DEV, _problem, log)
    else:
        if args.quick_bench:
            args.bench = True
            ms = QUICK_MS if not args.ms else ms
        if args.bench or args.untuned:
            _run("ceiling", copy_ceiling)
        ceiling = (RESULTS.get("ceiling") or {}).get("copy_bytes_per_s", float("nan"))
        if args.correctness:
            _run("correctness", part_correctness, shapes, ms if args.ms else (1, 7, 33), smoke=False)
        if args.sass:
            _run("sass", part_sass, out)
        if args.compiles:
            _run("compiles", part_compiles, TUNED["Mixtral-8x7B/TP8"], "bf16", 512)
        if args.bench:
            _run("bench", part_bench, shapes, ms, dtypes, ceiling, args.sets, args.replays,
                 "bench")
        if args.untuned:
            _run("untuned", part_bench, UNTUNED, ms, dtypes, ceiling, args.sets,
                 args.replays, "untuned")
        if args.decode_split:
            _run("decode-split", part_decode_split, shapes, ms, dtypes, args.sets, args.replays)
        _fp8_formats(args, ms if args.ms else None)
    _save(out)
    _summary()
    log(f"total {time.perf_counter() - t0:.0f}s; results in {out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
