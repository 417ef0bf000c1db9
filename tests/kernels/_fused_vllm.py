"""vLLM's own layers the fused kernels are checked against (RMSNorm.forward_native, get_rope's
RotaryEmbedding.forward_native), built outside an engine under a current vLLM config, and the
tests' fresh random inputs."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TOL = {torch.float32: 2e-6, torch.float16: 2e-3}      # relative, against float64


@contextlib.contextmanager
def vllm_config() -> Iterator[None]:
    """A default VllmConfig as the current one (vLLM's custom ops read it when built)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def generator() -> torch.Generator:
    """A generator seeded afresh on every run."""
    return torch.Generator().manual_seed(torch.seed() % 2 ** 31)


def vllm_rms_norm(weight: torch.Tensor, eps: float):
    """vLLM's RMSNorm with this weight [K] (its dtype)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(weight.shape[0], eps=eps, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def vllm_rope(head_dim: int, rot_dim: int, max_pos: int, neox: bool, dtype: torch.dtype):
    """vLLM's get_rope for a head of head_dim with rot_dim rotated columns (its
    partial_rotary_factor), theta 10000, in dtype."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rot_dim / head_dim}
    return get_rope(head_dim, max_position=max_pos, is_neox_style=neox, rope_parameters=params, dtype=dtype)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, ulps: float = 1.0) -> bool:
    """out within `ulps` units of dtype's last place of ref (relative), plus a floor at the
    scale of the row's mean magnitude times the relative tolerance."""
    eps = torch.finfo(dtype).eps
    floor = TOL[dtype] * ref.abs().mean().item()
    return bool(((out.double() - ref.double()).abs() <= ulps * eps * ref.double().abs() + floor).all())
