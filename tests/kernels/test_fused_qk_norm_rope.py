"""Q/K RMSNorm + RoPE (+ the KV-cache write) in one launch (moe_serve.kernels.fused.qk_norm_rope) under
TRITON_INTERPRET=1, fp16 and fp32, fresh random inputs, poisoned outputs and caches, against a
float64 reference and against vLLM's own layers: RMSNorm.forward_native per head (Qwen3's
q_norm / k_norm), then get_rope(...).forward_native; the cache write against
reshape_and_cache_flash's semantics (moe_serve.kernels.fused.reference.write_kv_cache: vLLM's CUDA and
Triton kernels do not run on this CPU build)."""
from __future__ import annotations

import pytest
import torch

from moe_serve.bench.experts.reference import rel_err
from moe_serve.kernels.fused import reference
from moe_serve.kernels.fused.qk_norm_rope import qk_norm_rope, unsupported
from tests.kernels._fused_vllm import TOL, close, generator, vllm_config, vllm_rms_norm, vllm_rope

EPS = 1e-6
MAX_POS = 64


def _inputs(T: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype):
    g = generator()
    qkv = (3 * torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)).to(dtype)
    positions = torch.randint(0, MAX_POS, (T,), generator=g)
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    return qkv, positions, qw, kw


def _float64(qkv, positions, qw, kw, cache, Hq, Hkv, D, rot, neox):
    """(q, k) [T, H, D] in float64: the norm and the rotation without intermediate rounding."""
    T = qkv.shape[0]
    x = qkv.double().view(T, Hq + 2 * Hkv, D)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    q, k = h[:, :Hq] * qw.double(), h[:, Hq:Hq + Hkv] * kw.double()
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    return tuple(torch.cat((reference.rope(t[..., :rot], cos, sin, neox), t[..., rot:]), -1) for t in (q, k))


def _vllm(qkv, positions, qw, kw, Hq, Hkv, D, rot, neox):
    """(q, k) [T, H * D] by Qwen3MoeAttention's code: q_norm / k_norm per head, then rotary_emb,
    each vLLM's forward_native; and the rope's cos_sin_cache."""
    T = qkv.shape[0]
    with vllm_config():
        rope = vllm_rope(D, rot, MAX_POS, neox, qkv.dtype)
        q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = vllm_rms_norm(qw, EPS).forward_native(q.reshape(T, Hq, D)).reshape(T, Hq * D)
        k = vllm_rms_norm(kw, EPS).forward_native(k.reshape(T, Hkv, D)).reshape(T, Hkv * D)
        q, k = rope.forward_native(positions, q, k)
    return q, k, rope.cos_sin_cache


CASES = [  # T, Hq, Hkv, D, rot_dim, neox, dtype, cache layout
    (1, 4, 2, 64, 64, True, torch.float16, "flash"),
    (5, 4, 2, 64, 32, True, torch.float32, "split"),       # partial rotary
    (16, 3, 1, 32, 32, False, torch.float16, "split"),     # GPT-J pairs, 16 tokens
    (3, 2, 2, 80, 40, False, torch.float32, "flash"),      # D not a power of two, partial GPT-J
    (7, 4, 1, 64, 64, True, torch.float16, None),          # no cache, in place
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-rot{c[4]}-"
                         f"{'neox' if c[5] else 'gptj'}-{str(c[6])[6:]}-{c[7]}")
def test_against_vllm_and_float64(case: tuple) -> None:
    T, Hq, Hkv, D, rot, neox, dtype, layout = case
    qkv, positions, qw, kw = _inputs(T, Hq, Hkv, D, dtype)
    q_v, k_v, cos_sin = _vllm(qkv, positions, qw, kw, Hq, Hkv, D, rot, neox)
    q64, k64 = _float64(qkv, positions, qw, kw, cos_sin, Hq, Hkv, D, rot, neox)
    kv_cache = None
    if layout is not None:                  # [blocks, 2, block_size, Hkv, D] (split: K and V
        blocks, bs = 5, 4                   # strided views) or [2, blocks, ...] (flash)
        shape = (blocks, 2, bs, Hkv, D) if layout == "split" else (2, blocks, bs, Hkv, D)
        kv = torch.full(shape, float("nan"), dtype=dtype)
        kc, vc = (kv[:, 0], kv[:, 1]) if layout == "split" else (kv[0], kv[1])
        slots = torch.randperm(blocks * bs, generator=generator())[:T]
        slots[T // 2] = -1                                         # a padding token
        kv_cache = (kc, vc, slots)
    before = qkv.clone()
    if layout is None:                      # in place: q | k over qkv's first columns
        out = qk_norm_rope(qkv, positions, qw, kw, EPS, cos_sin, Hq, Hkv, D, rot, neox)
        assert out.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, (Hq + Hkv) * D:], before[:, (Hq + Hkv) * D:])
    else:
        out = torch.full((T, (Hq + Hkv) * D), float("nan"), dtype=dtype)
        assert qk_norm_rope(qkv, positions, qw, kw, EPS, cos_sin, Hq, Hkv, D, rot, neox, kv_cache, out=out) is out
        assert torch.equal(qkv, before)
    q, k = out[:, :Hq * D], out[:, Hq * D:]
    for ours, theirs, exact in ((q, q_v, q64), (k, k_v, k64)):
        assert not ours.isnan().any() and rel_err(ours, exact.reshape(ours.shape)) < TOL[dtype]
        assert close(ours, theirs, dtype, ulps=3), (ours - theirs).abs().max()
    if kv_cache is not None:               # exactly reshape_and_cache_flash of our k and of v
        kc, vc, slots = kv_cache
        want_k, want_v = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
        reference.write_kv_cache(k.reshape(T, Hkv, D), before[:, (Hq + Hkv) * D:].reshape(T, Hkv, D), want_k,
                                 want_v, slots)
        for got, want in ((kc, want_k), (vc, want_v)):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0), want.nan_to_num(0))


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    qkv, positions, qw, kw = _inputs(2, 2, 1, 16, torch.float16)
    cs = torch.zeros(MAX_POS, 16, dtype=torch.float16)
    cache = (torch.zeros(3, 4, 1, 16, dtype=torch.float16), torch.zeros(3, 4, 1, 16, dtype=torch.float16),
             torch.zeros(2, dtype=torch.int64))
    ok = (qkv, positions, qw, kw, cs, 2, 1, 16, 16, cache)
    assert unsupported(*ok) is None
    bad = {
        "qkv": (qkv[:, :48], *ok[1:]),
        "positions": (qkv, positions.float(), *ok[2:]),
        "norm weights": (qkv, positions, qw[:8], *ok[3:]),
        "rot_dim": (*ok[:8], 15, cache),
        "cos_sin_cache": (*ok[:4], cs[:, :8], *ok[5:]),
        "key / value cache": (*ok[:9], (cache[0][:, :, :, :8], cache[1], cache[2])),
        "cache dtype": (*ok[:9], (cache[0].float(), cache[1].float(), cache[2])),
        "slot_mapping": (*ok[:9], (cache[0], cache[1], cache[2][:1])),
    }
    for why, args in bad.items():
        assert unsupported(*args).startswith(why), (why, unsupported(*args))
        with pytest.raises(ValueError, match=why):
            qk_norm_rope(*args[:4], EPS, *args[4:9], True, args[9])
    with pytest.raises(ValueError, match="out"):
        qk_norm_rope(*ok[:4], EPS, *ok[4:9], True, out=torch.empty(2, 47, dtype=torch.float16))
