"""The MoE router at decode in one launch: gate GEMV, scoring, top-k and renormalisation.

For x [M, K] and the gate's weight w [E, K]:

    logits[m, e] = sum_k x[m, k] * w[e, k]                       (fp32)
    score        = softmax(logits[m]) | sigmoid(logits[m])
    ids[m]       = the topk experts of score (+ bias[e], where the model has a correction bias)
    weights[m]   = score[ids] (/ their sum if renormalize) * scaling

router_topk_kernel   grid (M, cdiv(E, BLOCK_E), SPLIT_K)
    Program (m, e-block, s) reduces its share of K for BLOCK_E experts. With one program per
    token (BLOCK_E covers E, SPLIT_K 1) it goes straight to the top-k. Else it adds its fp32
    partial logits into a workspace row with atomics, and the program that arrives last at the
    token (moe_serve.kernels.moe.moe_decode's arrival counter) reads the row back while zeroing it and
    runs the top-k: the workspace is zero again after every call, so no memset launch, and the
    one launch replaces vLLM's gate GEMM and top-k kernels under CUDA graphs.
    With moe_serve.kernels.moe.launch.block_pdl it is a programmatic dependent launch (USE_PDL): it waits
    for the kernel before it before touching memory and lets the next kernel (our decode path's
    up kernel, itself a dependent launch that waits for us) launch during its tail.

With `counts` (a layer's expert load, int64 [E]) the program that picks a token's experts also
adds them there (moe_serve.kernels.moe.expert_count's sum, tokens m < num_tokens only): the expert load is
counted inside this launch, at no extra launch at decode.

Top-k (`method`): "rounds", TOPK rounds of argmax over the E_P2 scores (each a reduction across
the program), or "sort", one bitonic top-k (tl.topk) over 64-bit keys: the choice value's
order-preserving bits, then E_P2 - 1 - expert. Both pick the same experts in the same order, ties to
the lower expert id (torch.topk's order on equal values is unspecified). Not covered (the caller
keeps vLLM's router): grouped top-k, scoring functions other than softmax and sigmoid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.kernels.moe.aot import compile_launches
from moe_serve.kernels.moe.launch import block_pdl, jit, launch, record_launches
from moe_serve.kernels.moe.moe_tiles import _arrive_last, _take_row
from moe_serve.kernels.moe.moe_decode_launch import split_workspace

SOFTMAX, SIGMOID = 0, 1
SCORING = {"softmax": SOFTMAX, "sigmoid": SIGMOID}
MAX_EXPERTS = 1024          # E_P2 scores live in one program's registers
TARGET_PROGRAMS = 128       # per call at small M: enough loads in flight to stream the gate
TILE = 4096                 # gate elements a program loads per K step (BLOCK_E x BLOCK_K)
MAX_M = 16                  # the serving path's largest M (moe_serve.kernels.plugin.router_hook)
MAX_WORK = 1 << 21          # gate multiply-adds (M * E * K) up to which one launch beats vLLM's two
TOPK_METHODS = ("rounds", "sort")
SERVED_TOPK_METHOD = "rounds"   # what serving launches; `moe-serve bench kernels --router` times both


def max_tokens(E: int, K: int) -> int:
    """The largest M (<= MAX_M) at which one launch of ours serves a router with E experts over
    hidden size K: M * E * K <= MAX_WORK. Past it the split GEMV loses to vLLM's cuBLAS gate plus
    fused top-k (H200: ours 1.03-2.37x at or under it, 0.55-0.90x over it,
    on four router shapes, M = 1..16). 0: never ours."""
    return min(MAX_M, MAX_WORK // (E * K))


@jit(do_not_specialize=["M"])
def router_topk_kernel(
    # pointers (ws_ptr [>= M * E_P2] fp32 and cnt_ptr [>= M] int32: the split workspace, zero
    # between calls; unused with one program per token; counts_ptr [E] int64 and num_tokens_ptr
    # [1] int32: the expert load, with COUNT)
    x_ptr, w_ptr, bias_ptr, topk_w_ptr, topk_ids_ptr, ws_ptr, cnt_ptr, counts_ptr, num_tokens_ptr,
    # sizes and strides (elements); scaling: routed scaling factor
    M, K, E, stride_xm, stride_we, scaling,
    # meta
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, SCORING_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, E_P2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ONE_PROGRAM: tl.constexpr, USE_PDL: tl.constexpr, COUNT: tl.constexpr = False,
    SORT_TOPK: tl.constexpr = False,
):
    m = tl.program_id(0)
    if COUNT:                          # written before the forward, not by a kernel before us:
        real_row = m < tl.load(num_tokens_ptr)   # its latency hides under the wait and the GEMV
    if USE_PDL:                        # launched early: let the MoE kernels after us launch, and
        tl.extra.cuda.gdc_launch_dependents()   # wait for the kernel before us (the hidden
        tl.extra.cuda.gdc_wait()       # states' norm) before reading or writing anything
    pid_e = tl.program_id(1)
    s = tl.program_id(2)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K       # K columns of split s
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)                   # [BLOCK_E]
    for k0 in range(s * k_span, tl.minimum(s * k_span + k_span, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_k[None, :],
                     mask=e_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    offs = tl.arange(0, E_P2)
    mask = offs < E
    if ONE_PROGRAM:
        logits = acc                                               # BLOCK_E == E_P2
    else:
        row = ws_ptr + m * E_P2
        tl.atomic_add(row + offs_e, acc, mask=e_mask, sem="relaxed", scope="gpu")
        if not _arrive_last(cnt_ptr + m, tl.num_programs(1) * SPLIT_K):
            return
        logits = _take_row(row + offs, mask, E_P2)
    if SCORING_FN == 0:
        lg = tl.where(mask, logits, float("-inf"))
        p = tl.exp(lg - tl.max(lg, axis=0))
        score = p / tl.sum(p, axis=0)
    else:
        score = tl.sigmoid(logits)
    sel = score
    if HAS_BIAS:
        sel += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sel = tl.where(mask, sel, float("-inf"))
    slot = tl.arange(0, TOPK_P2)
    if SORT_TOPK:                      # one bitonic top-k over (choice value, expert) keys
        bits = sel.to(tl.uint32, bitcast=True)                     # order-preserving as unsigned:
        key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)   # negatives flipped, sign set
        key = (key.to(tl.uint64) << 32) | (E_P2 - 1 - offs).to(tl.uint64)   # ties: lower expert
        top = tl.topk(key, TOPK_P2)                                # [TOPK_P2], largest first
        top_id = (E_P2 - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
        hit = offs[None, :] == top_id[:, None]                     # [TOPK_P2, E_P2]
        top_w = tl.where(slot < TOPK, tl.sum(tl.where(hit, score[None, :], 0.0), axis=1), 0.0)
    else:                              # TOPK rounds of argmax
        top_w = tl.zeros((TOPK_P2,), dtype=tl.float32)
        top_id = tl.zeros((TOPK_P2,), dtype=tl.int32)
        for j in tl.static_range(TOPK):
            best = tl.argmax(sel, axis=0, tie_break_left=True)
            top_w = tl.where(slot == j, tl.sum(tl.where(offs == best, score, 0.0), axis=0), top_w)
            top_id = tl.where(slot == j, best, top_id)
            sel = tl.where(offs == best, float("-inf"), sel)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out = m * TOPK + slot
    tl.store(topk_w_ptr + out, top_w * scaling, mask=slot < TOPK)
    tl.store(topk_ids_ptr + out, top_id, mask=slot < TOPK)
    if COUNT:                          # this token's experts into the layer's expert load
        real = slot < tl.where(real_row, TOPK, 0)
        tl.atomic_add(counts_ptr + top_id, tl.full((TOPK_P2,), 1, tl.int64), mask=real, sem="relaxed")


def launch_plan(M: int, E: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_K, SPLIT_K) for M tokens: about TARGET_PROGRAMS programs in all, so a
    one-token call streams the gate from many SMs; one program per token where M alone fills
    the GPU or E and K are too small to split."""
    e_p2 = triton.next_power_of_2(E)
    block_e = min(e_p2, 32)
    block_k = min(128, max(16, triton.next_power_of_2(K)))
    e_blocks = triton.cdiv(E, block_e)
    split = max(1, min(triton.cdiv(K, block_k), TARGET_PROGRAMS // max(1, M * e_blocks)))
    split = 1 << (split.bit_length() - 1)                          # powers of two: few variants
    if e_blocks * split == 1 or M >= TARGET_PROGRAMS:
        return e_p2, max(16, min(block_k, TILE // e_p2)), 1
    return block_e, block_k, split


def router_topk(x: torch.Tensor, gate_w: torch.Tensor, topk: int, scoring: str = "softmax",
                renormalize: bool = True, bias: torch.Tensor | None = None, scaling: float = 1.0,
                out: tuple[torch.Tensor, torch.Tensor] | None = None,
                counts: tuple[torch.Tensor, torch.Tensor] | None = None,
                method: str = SERVED_TOPK_METHOD) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [M, topk], topk_ids int32 [M, topk]) for hidden states x [M, K] and
    the gate's weight gate_w [E, K] (see the module doc); bias: [E] correction added for the
    choice only; out: that pair to write into (else fresh tensors); counts: (expert load int64
    [E], num_tokens int32 [1]) to add the first num_tokens tokens' experts to; method: the top-k
    (TOPK_METHODS, see the module doc). No host sync: CUDA-graph capturable."""
    if x.dim() != 2 or gate_w.dim() != 2 or x.shape[1] != gate_w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and gate_w {tuple(gate_w.shape)} must be [M, K] and [E, K]")
    M, K = x.shape
    E = gate_w.shape[0]
    if method not in TOPK_METHODS:
        raise ValueError(f"method {method!r} not in {TOPK_METHODS}")
    if scoring not in SCORING:
        raise ValueError(f"scoring {scoring!r} not in {sorted(SCORING)}")
    if not 1 <= topk <= E or E > MAX_EXPERTS:
        raise ValueError(f"need 1 <= topk ({topk}) <= E ({E}) <= {MAX_EXPERTS}")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias {tuple(bias.shape)} must be [E={E}]")
    if x.stride(1) != 1 or gate_w.stride(1) != 1:
        raise ValueError("x and gate_w need unit stride along K")
    if out is None:
        out = (torch.empty((M, topk), dtype=torch.float32, device=x.device),
               torch.empty((M, topk), dtype=torch.int32, device=x.device))
    topk_w, topk_ids = out
    if (tuple(topk_w.shape), topk_w.dtype, tuple(topk_ids.shape), topk_ids.dtype) != \
            ((M, topk), torch.float32, (M, topk), torch.int32) or not (
            topk_w.is_contiguous() and topk_ids.is_contiguous()):
        raise ValueError(f"out must be contiguous fp32 and int32 [M={M}, topk={topk}]")
    if counts is not None and (tuple(counts[0].shape), counts[0].dtype, counts[1].numel(), counts[1].dtype) != \
            ((E,), torch.int64, 1, torch.int32):
        raise ValueError(f"counts must be (int64 [E={E}], int32 [1])")
    if M == 0:
        return topk_w, topk_ids
    e_p2 = triton.next_power_of_2(E)
    block_e, block_k, split = launch_plan(M, E, K)
    one = block_e == e_p2 and split == 1
    pdl = block_pdl()
    ws, cnt = (topk_w, topk_ids) if one else split_workspace(x.device, M * e_p2, M)
    launch(router_topk_kernel, (M, triton.cdiv(E, block_e), split),
           x, gate_w, bias if bias is not None else topk_w, topk_w, topk_ids, ws, cnt,
           *(counts if counts is not None else (topk_ids, topk_ids)),
           M, K, E, x.stride(0), gate_w.stride(0), float(scaling),
           TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), SCORING_FN=SCORING[scoring],
           HAS_BIAS=bias is not None, RENORMALIZE=renormalize, E_P2=e_p2, BLOCK_E=block_e,
           BLOCK_K=block_k, SPLIT_K=split, ONE_PROGRAM=one, USE_PDL=pdl, COUNT=counts is not None,
           SORT_TOPK=method == "sort", num_warps=4,
           **({"launch_pdl": True} if pdl else {}))
    return topk_w, topk_ids


def warm_router_variants(gate_w: torch.Tensor, topk: int, scoring: str, has_bias: bool,
                         max_m: int = MAX_M, compile_only: bool = False, count: bool = False) -> int:
    """Compile every variant router_topk launches for this gate at M = 1..max_m: run it on zero
    hidden states (or, compile_only, record the launches and compile them for sm_90 with
    moe_serve.kernels.moe.aot, no GPU needed); count: the variants that add the expert load (into scratch
    counts, num_tokens 0). Returns the number of distinct variants."""
    E, K = gate_w.shape
    dev = gate_w.device
    bias = torch.zeros(E, dtype=torch.float32, device=dev) if has_bias else None
    counts = (torch.zeros(E, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)) \
        if count else None
    seen: set[tuple] = set()
    for M in range(1, max_m + 1):
        x = torch.zeros((M, K), dtype=gate_w.dtype, device=dev)
        with record_launches() as launches:
            router_topk(x, gate_w, topk, scoring, bias=bias, counts=counts)
        key = tuple(sorted(launches[0][3].items()))
        if key in seen:
            continue
        seen.add(key)
        if compile_only:
            compile_launches(launches)
        else:
            router_topk(x, gate_w, topk, scoring, bias=bias, counts=counts)
    return len(seen)
