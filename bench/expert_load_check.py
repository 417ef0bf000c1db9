"""GPU check of the expert load: the count kernels on CUDA and under CUDA graphs, their
cost in a graph, and exact per-layer counts from real servers.

    python bench/expert_load_check.py --out runs/expert-load-check             # H100/H200 with vLLM
    python bench/expert_load_check.py --cpu-smoke --out /tmp/expert-load-check  # CPU: embedded model

1. kernels: moe_serve.kernels.moe.expert_count and router_topk's counts against an integer reference on
   fresh random inputs added into random counts (CUDA; on CPU under TRITON_INTERPRET=1).
2. graphs (CUDA only): L layers of router_topk with counts plus one count_experts launch captured
   in one CUDA graph, replayed with varying num_tokens (the padded rows must not count): exact
   counts; and the replay time of the L routers with counts against without, and of L count
   launches alone (median of CUDA-event timings; what counting adds at decode, per layer).
3. servers: `python -m moe_serve.service` on a dummy-weight MoE model (--model, --layers) per --modes
   (optimized: our router counts in its kernel at decode; vllm: vLLM's router, counted by our
   launch after select_experts), TP 1, CUDA graphs on. Requests of random token ids at c = 1,
   then 3 at once (a decode batch of 3 replayed from the graph of 4), then a prompt longer than
   our router's limit; each phase's delta of GET /v1/moe/expert-load must be exactly
   (prompt + output - 1) x top-k per layer, and the Prometheus families must be there.

Prints OK/BAD per check and a summary; exit 0 when every check is OK. Every wait is bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # the kernels' CPU check: Triton's interpreter

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moe_serve.bench.model_dirs import dummy_model_dir  # noqa: E402
from moe_serve.kernels.moe.expert_count import count_experts_triton  # noqa: E402
from moe_serve.kernels.moe.router_topk import max_tokens, router_topk  # noqa: E402
from moe_serve.kernels.tuning.timing import replay_median_us  # noqa: E402
from moe_serve.loadtest.server_proc import ServerProcess  # noqa: E402

T0 = time.monotonic()
KEY = "expert-load-check"
PATH = "/v1/moe/expert-load"
RESULTS: list[tuple[bool, str]] = []


def log(msg: str) -> None:
    print(f"[expert-load +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(ok: bool, what: str) -> bool:
    RESULTS.append((bool(ok), what))
    log(f"{'OK ' if ok else 'BAD'} {what}")
    return bool(ok)


def reference(ids: torch.Tensor, E: int, real: int) -> torch.Tensor:
    return torch.bincount(ids[:real].reshape(-1).long().cpu(), minlength=E)


# -- 1. kernels ----------------------------------------------------------------------------------
def kernel_checks(dev: str) -> None:
    for M, E, topk, ids_dtype in ((1, 128, 8, torch.int32), (300, 256, 8, torch.int64), (4097, 8, 2, torch.int32)):
        ids = torch.rand(M, E, device=dev).argsort(-1)[:, :topk].to(ids_dtype)
        for real in (M, M // 2, 0):
            counts = torch.randint(0, 1 << 40, (E,), dtype=torch.int64, device=dev)
            want = counts.cpu() + reference(ids, E, real)
            count_experts_triton(ids, counts, torch.tensor([real], dtype=torch.int32, device=dev))
            check(torch.equal(counts.cpu(), want), f"count_experts M={M} E={E} top-{topk} {ids_dtype} real={real}")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16    # bf16 tl.dot is wrong in the interpreter
    for M, E, K, topk in ((1, 128, 2048, 8), (8, 128, 2048, 8), (4, 8, 4096, 2), (2, 256, 7168, 8)):
        x = torch.randn(M, K, device=dev).to(dtype)
        w = (torch.randn(E, K, device=dev) / K ** 0.5).to(dtype)
        counts = torch.randint(0, 1 << 40, (E,), dtype=torch.int64, device=dev)
        before = counts.cpu().clone()                            # .cpu() of a CPU tensor is itself
        _, ids = router_topk(x, w, topk, counts=(counts, torch.tensor([M - 1], dtype=torch.int32, device=dev)))
        check(torch.equal(counts.cpu(), before + reference(ids, E, M - 1)),
              f"router_topk counts M={M} gate [{E}, {K}] top-{topk} (last row padding)")


# -- 2. graphs -------------------------------------------------------------------------------------
def graph_checks(layers: int, E: int, K: int, topk: int, M: int) -> None:
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    gates = [(torch.randn(E, K, device=dev) / K ** 0.5).to(torch.bfloat16) for _ in range(layers)]
    load = torch.zeros(layers, E, dtype=torch.int64, device=dev)
    num_tokens = torch.full((1,), M, dtype=torch.int32, device=dev)
    outs = [(torch.empty(M, topk, device=dev), torch.empty(M, topk, dtype=torch.int32, device=dev))
            for _ in range(layers)]
    extra = torch.zeros(E, dtype=torch.int64, device=dev)

    def step(count: bool) -> None:
        for i in range(layers):
            router_topk(x, gates[i], topk, out=outs[i], counts=(load[i], num_tokens) if count else None)
        if count:
            count_experts_triton(outs[0][1], extra, num_tokens)

    graphs = {}
    for count in (True, False):
        step(count)                                            # compile outside the capture
        torch.cuda.synchronize()
        graphs[count] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[count]):
            step(count)
    load.zero_()
    extra.zero_()
    want = torch.zeros(layers, E, dtype=torch.int64)
    for real in (M, 1, M - 1, 0, M):
        num_tokens.fill_(real)
        graphs[True].replay()
        torch.cuda.synchronize()
        want += torch.stack([reference(outs[i][1], E, real) for i in range(layers)])
        if not check(torch.equal(load.cpu(), want), f"graph replay, {layers} routers counting, real tokens {real}/{M}"):
            break
    check(int(extra.sum()) == int(want[0].sum()), "count_experts in the graph: the same counts as layer 0's router")
    with_counts, without = replay_median_us(graphs[True], 200), replay_median_us(graphs[False], 200)
    counter = torch.cuda.CUDAGraph()
    with torch.cuda.graph(counter):
        for i in range(layers):
            count_experts_triton(outs[i][1], load[i], num_tokens)
    alone = replay_median_us(counter, 200)
    log(f"cost in a CUDA graph ({layers} layers, gate [{E}, {K}] top-{topk}, M={M}): routers with counts "
        f"{with_counts:.1f} us vs without {without:.1f} us (+{(with_counts - without) / layers:.2f} us per layer, "
        f"one count launch included); {layers} count_experts launches alone {alone:.1f} us "
        f"({alone / layers:.2f} us per layer, where vLLM's router runs)")


# -- 3. servers ----------------------------------------------------------------------------------
def _load(srv: ServerProcess, since: float) -> dict:
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(srv.base_url + PATH, headers=srv.headers, timeout=30).json()
        if (body.get("as_of") or 0) > since or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def _complete(srv: ServerProcess, model: str, prompt_len: int, out_len: int) -> int:
    prompt = [random.randrange(1000, 31000) for _ in range(prompt_len)]
    r = httpx.post(srv.base_url + "/v1/completions", headers=srv.headers, timeout=300,
                   json={"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True})
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"] + usage["completion_tokens"] - 1


def server_checks(a: argparse.Namespace, mode: str, base: list[str], model: str, long_prompt: int) -> None:
    srv = ServerProcess(a.out, *base, "--moe-kernels", mode, api_key=KEY,
                        env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, log_name=f"server-{mode}.log")
    try:
        log(f"== {mode}: ready in {srv.wait_ready(a.ready_timeout, progress=log):.0f} s")
        phases = (("c=1", [(24, 12)]), ("3 at once (graph of 4)", [(20, 16), (28, 16), (36, 16)]),
                  (f"prompt {long_prompt} > the router's limit", [(long_prompt, 8)]))
        for name, requests in phases:
            before = _load(srv, time.time())
            with ThreadPoolExecutor(len(requests)) as pool:
                tokens = sum(pool.map(lambda pr: _complete(srv, model, *pr), requests))
            after = _load(srv, time.time())
            layers = after.get("layers") or []
            deltas = [sum(y["total"]) - sum(x["total"]) for x, y in zip(before["layers"], layers)]
            topk = layers[0]["top_k"] if layers else 0
            check(bool(layers) and deltas == [tokens * topk] * len(layers),
                  f"{mode} {name}: per-layer delta = {tokens} tokens x top-{topk} in {len(layers)} layers "
                  f"(got {sorted(set(deltas))})")
        text = httpx.get(srv.base_url + "/metrics", headers=srv.headers, timeout=30).text
        families = ("moe_serve_expert_load_routed_total", "moe_serve_expert_load_imbalance",
                    "moe_serve_expert_load_idle_experts", "moe_serve_expert_load_experts_bucket")
        check(all(f in text for f in families), f"{mode}: the Prometheus families are exported")
        check(httpx.get(srv.base_url + PATH, timeout=30).status_code == 401, f"{mode}: the endpoint needs the key")
        serving = [ln for ln in srv.log_path.read_text(errors="replace").splitlines() if "during serving" in ln]
        check(not serving, f"{mode}: no Triton compile while serving ({serving[:2]})")
        (a.out / f"expert_load_{mode}.json").write_text(json.dumps(_load(srv, time.time()), indent=1))
    except Exception as exc:  # noqa: BLE001 - report it, go on with the next mode
        check(False, f"{mode}: {exc!r}; log tail: {srv.tail(15)}")
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="bench/models/<name>/config.json, dummy weights")
    p.add_argument("--layers", type=int, default=4, help="the model cut to this many layers")
    p.add_argument("--modes", default="optimized,vllm", help="servers' --moe-kernels modes ('': no servers)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--cpu-smoke", action="store_true", help="CPU engine, embedded model; kernels interpreted")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    log(f"1. kernels on {'cuda' if cuda else 'cpu (interpreter)'}")
    kernel_checks("cuda" if cuda else "cpu")
    if cuda:
        log("2. CUDA graphs")
        graph_checks(48, 128, 2048, 8, 1)          # Qwen3-30B-A3B at c = 1
        graph_checks(32, 8, 4096, 2, 4)            # Mixtral-8x7B at c = 4
    env_interp = os.environ.pop("TRITON_INTERPRET", None)   # real compiles in the servers' workers
    if a.cpu_smoke:
        from moe_serve.loadtest.server_proc import MODEL_NAME

        model, base, long_prompt = MODEL_NAME, ["--tensor-parallel-size", "1"], 40
    else:
        d = dummy_model_dir(a.model, a.out, a.layers)
        cfg = json.loads((d / "config.json").read_text())
        long_prompt = 2 * max_tokens(cfg.get("num_experts") or cfg["num_local_experts"], cfg["hidden_size"]) + 40
        model, base = d.name, ["--model", str(d), "--served-model-name", d.name, "--engine-arg", "load_format=dummy",
                               "--max-model-len", "4096", "--tensor-parallel-size", "1"]
    modes = [m for m in a.modes.split(",") if m]
    log(f"3. servers ({', '.join(modes) or 'none'}) on {model}")
    for mode in modes:
        server_checks(a, mode, base, model, long_prompt)
    if env_interp is not None:
        os.environ["TRITON_INTERPRET"] = env_interp
    bad = [what for ok, what in RESULTS if not ok]
    log(f"{len(RESULTS) - len(bad)}/{len(RESULTS)} checks OK" + ("" if not bad else ": BAD " + "; ".join(bad)))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
