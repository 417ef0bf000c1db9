"""ncu probe (lab): the decode path's two kernels on the Qwen3-30B-A3B TP1 shape at M = 1 (bf16,
the shipped table's config), 8 layers of distinct weights in rotation, 40 calls."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.moe.fused_moe import fused_moe  # noqa: E402

E, N, K, topk, M, L = 128, 768, 2048, 8, 1, 8
g = torch.Generator(device="cuda").manual_seed(0)
w1 = [torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5 for _ in range(L)]
w2 = [torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, generator=g) / N ** 0.5 for _ in range(L)]
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
probs = torch.randn(M, E, device="cuda", generator=g).softmax(-1)
tw, ids = probs.topk(topk, -1)
tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
for i in range(40):
    fused_moe(x, w1[i % L], w2[i % L], tw, ids)
torch.cuda.synchronize()
print("probe done")
