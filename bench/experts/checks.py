"""The expert-kernel bench's checks: every variant of both paths against float64 into NaN-poisoned
outputs (`part_correctness`), and the compiled SASS uses the matrix instructions each tile should
(`part_sass`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from moe_serve.bench.experts.problem import DEV, log
from moe_serve.bench.experts.shapes import TUNED

def part_correctness(shapes: dict, ms: tuple, smoke: bool) -> list[dict]:
    """Every path (aligned: plain, swapped, split, x quantized once; decode: heuristic, swapped,
    narrow) in bf16 and fp8 W8A8 against the float64 reference, into NaN-poisoned outputs."""
    from moe_serve.kernels.moe import configs, smem
    from moe_serve.bench.experts.reference import quant_fp8

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
    from moe_serve.kernels.moe import heuristics
    from moe_serve.kernels.moe.config_schema import validate

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
    from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
    from moe_serve.bench.experts.reference import act_amax, moe_reference, rel_err

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
    from moe_serve.kernels.moe import aot
    from moe_serve.kernels.moe.fused_moe import Fp8Scales, fused_moe
    from moe_serve.kernels.moe.launch import record_launches

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
    r = subprocess.run([sys.executable, "-m", "moe_serve.service", "bench", "kernels", "--sass", "--out", str(sub)], env=env,
                       capture_output=True, text=True, timeout=600)
    log(r.stdout[-3000:], r.stderr[-2000:] if r.returncode else "")
    return json.loads((sub / "results.json").read_text()).get("sass", [])
