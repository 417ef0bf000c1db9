"""FlashInfer's CUTLASS fused-MoE module for sm_90a, built ahead of time on a CPU machine.

vLLM's FLASHINFER_CUTLASS MoE backend JIT-compiles FlashInfer's `fused_moe_90` module (182
CUDA units, far more than one device call) on first use. FlashInfer loads a prebuilt module
from `flashinfer/data/aot/<name>/<name>.so` instead, so this script builds that file off the
GPU host from the FlashInfer wheel and NVIDIA's pip toolkit (nvidia-cuda-nvcc & co, CUDA 13.0):

    python bench/flashinfer_aot.py objects --jobs 2      # CPU: generate, compile the FP8 subset
    python bench/flashinfer_aot.py link --out fused_moe_90.so
    python bench/flashinfer_aot.py install --so fused_moe_90.so   # host: into FlashInfer's AOT dir

Only the units FP8 per-tensor W8A8 needs are compiled: the common hand-written units, the
e4m3 x e4m3 GEMM dispatcher and the generated sm90 grouped-GEMM instantiations for e4m3 x
e4m3. The other dispatchers and instantiations (fp16/bf16/fp32, fp4, int4/int8 mixed-input)
are left out; each symbol they would define is linked to a stub that aborts with a message, so
the module loads and any call into a left-out path stops loudly instead of running something
else. FlashInfer's autotuner only profiles tactics of the input's own dtypes, so FP8 calls
never reach a stub.
Environment: PYTHONPATH with flashinfer-python (and apache-tvm-ffi), CUDA_HOME (nvcc 13.0),
FLASHINFER_WORKSPACE_BASE (where generated sources and objects go).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

FP8_GROUPED = re.compile(r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(\s*Sm90,\s*__nv_fp8_e4m3,\s*__nv_fp8_e4m3")
DISPATCHER = re.compile(r"moe_gemm_kernels_(\w+)\.cu")          # one MoeGemmRunner<A, B> per file


def spec():
    """FlashInfer's JitSpec of fused_moe_90 (generates the instantiation sources)."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    s = gen_cutlass_fused_moe_sm90_module()
    s.write_ninja()
    return s


def _fp8_or_common(src: Path) -> bool:
    """Generated instantiations and per-dtype GEMM dispatchers only for e4m3 x e4m3; the rest."""
    if src.name.endswith(".generated.cu"):
        return FP8_GROUPED.search(src.read_text()) is not None
    m = DISPATCHER.fullmatch(src.name)
    return m is None or m.group(1) == "fp8_fp8"


def selected_objects(s) -> tuple[list[Path], list[Path]]:
    """(objects to build, objects left out), from the compile edges of the spec's build.ninja."""
    keep, drop = [], []
    for line in s.ninja_path.read_text().splitlines():
        m = re.match(r"build (\S+): (cuda_)?compile (\S+)$", line)
        if m:
            (keep if _fp8_or_common(Path(m.group(3))) else drop).append(Path(m.group(1)))
    return keep, drop


def cmd_objects(a: argparse.Namespace) -> int:
    s = spec()
    keep, drop = selected_objects(s)
    print(f"{len(keep)} units to build, {len(drop)} left out; ninja: {s.ninja_path}", flush=True)
    return subprocess.call(["ninja", "-k", "0", f"-j{a.jobs}", "-f", str(s.ninja_path),
                            *map(str, keep)], cwd=s.build_dir)


def _link(objs: list[Path], extra: list[Path], out: Path, cuda: str) -> None:
    """FlashInfer's own link rule: $cxx $in -shared -L$cuda/lib64[/stubs] -lcudart -lcuda -lnvrtc."""
    lib = Path(cuda) / "lib64"
    subprocess.check_call([os.environ.get("CXX", "c++"), *map(str, objs), *map(str, extra), "-shared",
                           f"-L{lib}", f"-L{lib / 'stubs'}", "-lcudart", "-lcuda", "-lnvrtc",
                           "-o", str(out)])


def _undefined_trtllm(so: Path) -> list[str]:
    """Mangled symbols of FlashInfer's TensorRT-LLM kernels the module uses but does not define."""
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True,
                        text=True, check=True).stdout
    return sorted({ln.split()[-1] for ln in nm.splitlines()
                   if "tensorrt_llm" in ln or "cutlass_kernels" in ln})


def _stub_object(symbols: list[str], work: Path) -> Path:
    """An object defining each symbol as a function that prints its name and aborts."""
    asm = [".section .rodata", ".Lmsg: .ascii \"moe-serve flashinfer_aot: a left-out FlashInfer "
           "tactic was called; see bench/flashinfer_aot.py\\n\"", ".Lend:", ".text"]
    for sym in symbols:                              # write(2, msg, len); abort()
        asm += [f".globl {sym}", f".type {sym}, @function", f"{sym}:", "  movl $2, %edi",
                "  leaq .Lmsg(%rip), %rsi", "  movl $(.Lend - .Lmsg), %edx", "  call write@PLT",
                "  call abort@PLT"]
    src, obj = work / "left_out_stubs.s", work / "left_out_stubs.o"
    asm.append('.section .note.GNU-stack,"",@progbits')         # no executable stack
    src.write_text("\n".join(asm) + "\n")
    subprocess.check_call(["gcc", "-c", "-fPIC", str(src), "-o", str(obj)])
    return obj


def cmd_link(a: argparse.Namespace) -> int:
    s = spec()
    keep, _ = selected_objects(s)
    missing = [o for o in keep if not o.is_file()]
    if missing:
        print(f"{len(missing)} objects not built yet, e.g. {missing[0].name}; run `objects`",
              file=sys.stderr)
        return 1
    cuda = os.environ["CUDA_HOME"]
    out = Path(a.out).resolve()
    _link(keep, [], out, cuda)
    symbols = _undefined_trtllm(out)
    print(f"{len(symbols)} symbols of left-out units get abort stubs", flush=True)
    if symbols:
        _link(keep, [_stub_object(symbols, s.build_dir)], out, cuda)
    left = _undefined_trtllm(out)
    if left:
        print(f"still undefined: {left[:5]}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def cmd_install(a: argparse.Namespace) -> int:
    """Copy the module to FlashInfer's AOT path and load it the way FlashInfer will."""
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    s = gen_cutlass_fused_moe_sm90_module()
    s.aot_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a.so, s.aot_path)
    if not s.is_aot:
        print(f"FlashInfer does not see {s.aot_path} as its AOT module", file=sys.stderr)
        return 1
    s.build_and_load()               # the AOT branch: loads, every symbol resolved or stubbed
    print(f"installed and loaded {s.aot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("objects").add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    sub.add_parser("link").add_argument("--out", required=True)
    sub.add_parser("install").add_argument("--so", required=True)
    a = ap.parse_args(argv)
    return {"objects": cmd_objects, "link": cmd_link, "install": cmd_install}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
