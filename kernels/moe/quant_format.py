"""The weight/activation format of a MoE layer, as kernel config tables and routing name it.

| key                              | weights (fp8 scales)                        | activations                        |
|----------------------------------|---------------------------------------------|------------------------------------|
| 'bf16', 'fp16', 'fp32'           | unquantized                                 | the same dtype                     |
| 'fp8'                            | per tensor [E] or per channel [E, rows]     | static per-tensor scale            |
| 'fp8_w8a8,per_token'             | per channel (or per tensor)                 | dynamic, per token                 |
| 'fp8_w8a8,block_shape=[bn,bk]'   | per [bn, bk] block [E, rows/bn, cols/bk]    | dynamic, per token and bk columns  |

The block key is vLLM's own config-file naming (``dtype=fp8_w8a8,block_shape=[128,128]``);
'fp8' is the per-tensor W8A8 format the shipped tables were tuned for (a dynamic per-tensor
activation scale arrives as a per-tensor scale too: vLLM computes it before the experts).
Checkpoints: quant_method 'fp8' with weight_block_size -> block (DeepSeek-V3/R1, Kimi-K2,
Qwen3-*-FP8, GLM-4.5-FP8), without -> 'fp8'; compressed-tensors 'FP8-dynamic' (channel
weights, dynamic token activations) -> per_token.
"""
from __future__ import annotations

import re
from typing import Any

FP8 = "fp8"
PER_TOKEN = "fp8_w8a8,per_token"
_BLOCK = re.compile(r"^fp8_w8a8,block_shape=\[(\d+),(\d+)\]$")


class FormatError(ValueError):
    """A quantization our kernels do not serve."""


def block_key(bn: int, bk: int) -> str:
    """Key of block-scaled FP8 with [bn, bk] weight blocks (vLLM's config-file spelling)."""
    return f"fp8_w8a8,block_shape=[{int(bn)},{int(bk)}]"


def block_shape(key: str) -> tuple[int, int] | None:
    """(bn, bk) of a block key, else None."""
    m = _BLOCK.match(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_fp8(key: str) -> bool:
    return key == FP8 or key.startswith("fp8_w8a8")


def weight_dtype(key: str) -> str:
    """The weight dtype key ('fp8', 'bf16', 'fp16', 'fp32') of a format key."""
    return FP8 if is_fp8(key) else key


def of_checkpoint(quant_cfg: dict[str, Any] | None, quantization: str | None = None) -> str | None:
    """Format key of a HF config's quantization_config (None: unquantized). `quantization`
    (vLLM's --quantization) overrides its quant_method; 'fp8' without a checkpoint config is
    vLLM's online per-tensor FP8."""
    qc = quant_cfg or {}
    method = quantization or qc.get("quant_method")
    if method is None:
        return None
    if method == "fp8":
        wbs = qc.get("weight_block_size")
        return block_key(*wbs) if wbs else FP8
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise FormatError(f"quantization {method!r}: our kernels serve bf16/fp16 and FP8 W8A8 "
                      f"(quant_method fp8 or compressed-tensors FP8)")


def _compressed_tensors(qc: dict[str, Any]) -> str:
    """The FP8 scheme of a compressed-tensors config (its first config group)."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise FormatError("compressed-tensors config without config_groups")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise FormatError(f"compressed-tensors weights {w.get('type')}{w.get('num_bits')}: our "
                          f"kernels serve 8-bit float (FP8) weights")
    ws, ast = w.get("strategy"), a.get("strategy")
    if ws == "block" and ast == "group" and a.get("dynamic"):
        return block_key(*w["block_structure"])
    if ws in ("channel", "tensor") and ast == "token" and a.get("dynamic"):
        return PER_TOKEN
    if ws in ("channel", "tensor") and ast == "tensor" and not a.get("dynamic"):
        return FP8
    raise FormatError(f"compressed-tensors FP8 weights {ws} with activations {ast} "
                      f"(dynamic={a.get('dynamic')}): no kernel format for it")
