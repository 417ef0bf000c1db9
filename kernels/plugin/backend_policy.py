"""Which vLLM MoE backend (`moe_backend` engine arg) to ask for, per quantization scheme,
GPU architecture and expected batch range.

vLLM 0.26 and 0.32 both take ``AsyncEngineArgs(moe_backend=...)`` (``KernelConfig.moe_backend``,
CLI ``--moe-backend``) with values "auto", "triton", "cutlass", "flashinfer_cutlass",
"flashinfer_trtllm", "deep_gemm", "marlin", ... ("auto" lets vLLM's oracle pick).

The table (first matching row wins; ``None`` = leave vLLM's "auto"):

| quant scheme    | arch  | batch (max_num_seqs) | moe_backend | why |
|-----------------|-------|----------------------|-------------|-----|
| fp8_per_tensor  | sm90  | <= 1024              | triton      | Triton fused (scale+GEMM+routed weight in one kernel) beats FlashInfer/vLLM CUTLASS at small, variable M; vLLM's default is FLASHINFER_CUTLASS (or VLLM_CUTLASS without FlashInfer). Our plugin serves TritonExperts. |
| fp8_per_tensor  | sm90  | > 1024               | None        | prefill-heavy large batches: no measurement says Triton wins there; keep vLLM's choice |
| fp8_per_channel | sm90  | any                  | triton      | same kernel family, per-channel weight scales in the epilogue |
| fp8_block       | sm90  | any                  | None        | vLLM already prefers Triton for TP and FlashInfer CUTLASS for EP |
| none (16-bit)   | sm90  | any                  | triton      | vLLM's auto picks TRITON on Hopper unless FlashInfer is first; explicit so our kernels serve it |
| any             | other | any                  | None        | kernels are tuned for Hopper only |
| other quant     | any   | any                  | None        | int4/int8/mxfp4/nvfp4: not ours |

An explicit ``--engine-arg moe_backend=...`` always wins; ``--moe-kernels vllm`` (stock A/B)
applies no policy at all.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LARGE_BATCH_SEQS = 1024  # above this max_num_seqs the fp8 per-tensor row keeps vLLM's choice


@dataclass(frozen=True)
class Row:
    """One policy row; None in a match field means 'any'."""

    scheme: str | None
    arch: str | None
    max_seqs_le: int | None  # row applies when max_num_seqs <= this (None: any)
    min_seqs_gt: int | None  # row applies when max_num_seqs > this (None: any)
    backend: str | None
    why: str


TABLE: tuple[Row, ...] = (
    Row("fp8_per_tensor", "sm90", LARGE_BATCH_SEQS, None, "triton",
        "FP8 per-tensor on Hopper: Triton fused beats FlashInfer CUTLASS at small, variable M"),
    Row("fp8_per_tensor", "sm90", None, LARGE_BATCH_SEQS, None,
        "FP8 per-tensor, large batches: keep vLLM's choice (no measurement favours Triton)"),
    Row("fp8_per_channel", "sm90", None, None, "triton", "FP8 per-channel on Hopper: Triton fused"),
    Row("fp8_block", "sm90", None, None, None, "FP8 block: vLLM already picks Triton for TP"),
    Row("none", "sm90", None, None, "triton", "16-bit on Hopper: Triton (our kernels)"),
    Row(None, None, None, None, None, "not Hopper or not a scheme of ours: vLLM's auto"),
)


@dataclass(frozen=True)
class Decision:
    """The chosen backend (None = vLLM 'auto'), where it came from and why."""

    backend: str | None
    source: str  # 'policy' | 'user' | 'stock'
    reason: str
    scheme: str
    arch: str

    @property
    def label(self) -> str:
        """Value for metrics labels."""
        return self.backend or "auto"


def _matches(row: Row, scheme: str, arch: str, max_num_seqs: int | None) -> bool:
    """max_num_seqs None (vLLM's default) counts as not large."""
    seqs_ok = (row.max_seqs_le is None or max_num_seqs is None or max_num_seqs <= row.max_seqs_le) and (
        row.min_seqs_gt is None or (max_num_seqs is not None and max_num_seqs > row.min_seqs_gt))
    return (row.scheme is None or row.scheme == scheme) and (row.arch is None or row.arch == arch) and seqs_ok


def choose(scheme: str, arch: str, max_num_seqs: int | None, *, mode: str = "optimized",
           user_backend: str | None = None) -> Decision:
    """Apply the table. user_backend (explicit engine arg) wins; mode 'vllm' = stock."""
    if user_backend:
        return Decision(str(user_backend), "user", "explicit --engine-arg moe_backend", scheme, arch)
    if mode == "vllm":
        return Decision(None, "stock", "--moe-kernels vllm: stock vLLM defaults", scheme, arch)
    for row in TABLE:
        if _matches(row, scheme, arch, max_num_seqs):
            return Decision(row.backend, "policy", row.why, scheme, arch)
    raise AssertionError("the last row matches everything")


def arch_name(capability: tuple[int, int] | None) -> str:
    """'sm90' for (9, 0), 'cpu' for None."""
    return "cpu" if capability is None else f"sm{capability[0]}{capability[1]}"


def device_capability() -> tuple[int, int] | None:
    """GPU 0's compute capability without creating a CUDA context here (vLLM uses NVML)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return None
        cap = current_platform.get_device_capability()
        return None if cap is None else (int(cap.major), int(cap.minor))
    except Exception:  # noqa: BLE001 - no GPU / no NVML: treat as CPU
        return None


def quant_scheme(quantization: str | None, model_dir: str | None) -> str:
    """'none' | 'fp8_per_tensor' | 'fp8_per_channel' | 'fp8_block' | 'other' from the
    --quantization flag and the checkpoint's config.json quantization_config."""
    qcfg: dict[str, Any] = {}
    if model_dir and (Path(model_dir) / "config.json").is_file():
        try:
            qcfg = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            qcfg = {}
    method = (quantization or qcfg.get("quant_method") or "").lower()
    if not method:
        return "none"
    if method == "fp8":
        if qcfg.get("weight_block_size"):
            return "fp8_block"
        return "fp8_per_tensor"
    if method in ("compressed-tensors", "compressed_tensors"):
        return _compressed_tensors_scheme(qcfg)
    return "other"


def _compressed_tensors_scheme(qcfg: dict[str, Any]) -> str:
    """fp8 W8A8 schemes of a compressed-tensors config (first group)."""
    for group in (qcfg.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("type") == "float" and int(w.get("num_bits", 0)) == 8:
            return {"tensor": "fp8_per_tensor", "channel": "fp8_per_channel",
                    "block": "fp8_block"}.get(w.get("strategy"), "other")
    return "other"


def decide(engine_kwargs: dict[str, Any], mode: str, model_dir: str | None,
           capability: tuple[int, int] | None = None, detect: bool = True) -> Decision:
    """The decision for one engine start (reads the kwargs, does not change them)."""
    cap = capability if capability is not None or not detect else device_capability()
    scheme = quant_scheme(engine_kwargs.get("quantization"), model_dir)
    raw = engine_kwargs.get("max_num_seqs")
    seqs = None if raw in (None, "") else int(raw)
    return choose(scheme, arch_name(cap), seqs, mode=mode, user_backend=engine_kwargs.get("moe_backend"))


def apply(engine_kwargs: dict[str, Any], mode: str, model_dir: str | None) -> Decision:
    """Decide, set kwargs['moe_backend'] when the policy picks one, log the choice."""
    d = decide(engine_kwargs, mode, model_dir)
    if d.backend is not None and d.source == "policy":
        engine_kwargs["moe_backend"] = d.backend
    logger.info("MoE backend: %s (source=%s, scheme=%s, arch=%s): %s", d.label, d.source, d.scheme,
                d.arch, d.reason)
    return d
