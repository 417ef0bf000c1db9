"""One process of the fixed-batch decode A/B: one engine, one MoE variant, steady-state decode.

    python bench/decode_probe.py --model DIR --variant stock --batches 1,8,32,64 --out run.json

Starts vLLM's offline engine (`vllm.LLM`, dummy weights, CUDA graphs for exactly the batch
sizes measured), then for each batch size B runs B sequences with `ignore_eos`, once `--short`
and once `--long` tokens: the decode step time is (t_long - t_short) / (long - short), so
prefill and per-request costs cancel, and output tok/s = B / step. Each B is warmed up twice
before `--reps` timed pairs. The variant decides only the MoE kernels (the environment and
`moe_backend` below); everything else is the same.

The B sequences must differ, or every token of a decode step routes to the same top-k experts
(identical sequences have identical hidden states) and the MoE layers read k experts' weights
instead of the spread a real batch reads. By default each sequence has its own fixed prompt and
tokens are sampled at temperature 1 (dummy weights give near-uniform logits, so sampled tokens,
hence routing, spread like random routing); each row records how many of the B outputs are
distinct. `--prompts same --temperature 0` gives the identical-sequence case.

`--profile` then records, in the same engine after the timed runs, one short and one long
generate per B under vLLM's torch profiler and adds their summaries (bench/decode_profile.py) to
the run file: GPU busy and MoE kernel time per decode step. Without it the profiler is not built.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# variant -> (environment, engine kwargs). VLLM_PLUGINS="" loads no vLLM plugin at all (stock).
VARIANTS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "stock": ({"VLLM_PLUGINS": ""}, {}),
    "vllm-triton": ({"VLLM_PLUGINS": ""}, {"moe_backend": "triton"}),
    "moe-serve": ({"VLLM_PLUGINS": "moe_serve_kernels", "MOE_SERVE_MOE_KERNELS": "optimized"},
                  {"moe_backend": "triton"}),
}


def log(msg: str) -> None:
    print(f"[probe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_llm(model: str, variant: str, batches: list[int], max_len: int, gpu_util: float,
             extra: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(model=model, load_format="dummy", max_model_len=max_len, max_num_seqs=max(batches),
               gpu_memory_utilization=gpu_util, seed=0, enable_prefix_caching=False,
               compilation_config={"cudagraph_capture_sizes": sorted(batches)},
               **VARIANTS[variant][1], **extra)


def make_prompts(B: int, length: int, distinct: bool) -> list[list[int]]:
    """B fixed prompts of `length` token ids (the same for every run): sequence b's own, or
    sequence 0's for all of them."""
    return [[(7 * i + (997 * b if distinct else 0)) % 31000 + 100 for i in range(length)] for b in range(B)]


def generate(llm: Any, prompts: list[list[int]], tokens: int, temperature: float) -> tuple[float, int]:
    """(wall seconds, distinct outputs) for the prompts, each decoding exactly `tokens` tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=temperature)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [tokens] * len(prompts):
        raise RuntimeError(f"expected {tokens} tokens per sequence, got {got}")
    return dt, len({tuple(o.outputs[0].token_ids) for o in outs})


def measure(llm: Any, batches: list[int], short: int, long: int, reps: int, prompt_len: int,
            distinct: bool, temperature: float) -> list[dict[str, Any]]:
    rows = []
    for B in batches:
        prompts = make_prompts(B, prompt_len, distinct)
        for _ in range(2):
            generate(llm, prompts, short, temperature)
            generate(llm, prompts, long, temperature)
        steps = []
        for _ in range(reps):
            (ts, _), (tl, n_distinct) = (generate(llm, prompts, short, temperature),
                                         generate(llm, prompts, long, temperature))
            steps.append((tl - ts) / (long - short))
        step = statistics.median(steps)
        rows.append({"B": B, "step_ms": step * 1e3, "tok_s": B / step,
                     "step_ms_reps": [s * 1e3 for s in steps], "distinct_outputs": n_distinct})
        log(f"B={B}: step {step * 1e3:.3f} ms, {B / step:.0f} tok/s, {n_distinct} distinct outputs "
            f"(reps {', '.join(f'{s * 1e3:.3f}' for s in steps)})")
    return rows


def profile(llm: Any, trace_dir: Path, batches: list[int], short: int, long: int, prompt_len: int,
            distinct: bool, temperature: float, keep: Path | None) -> dict[str, Any]:
    """B -> {"tokens": [short, long], "short": trace summary, "long": trace summary}."""
    import decode_profile

    out = {}
    for B in batches:
        prompts = make_prompts(B, prompt_len, distinct)
        out[str(B)] = {"tokens": [short, long], **{
            name: decode_profile.record(llm, trace_dir, f"B{B}-{name}",
                                        lambda n=n: generate(llm, prompts, n, temperature), keep)
            for name, n in (("short", short), ("long", long))}}
        log(f"B={B}: profiled")
    return out


WORKLOAD_ARGS = ("batches", "short", "long", "reps", "prompt_len", "prompts", "temperature",
                 "gpu_memory_utilization")


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options that define what a probe process measures (decode_ab.py forwards them)."""
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--short", type=int, default=32, help="tokens in the short run")
    ap.add_argument("--long", type=int, default=160, help="tokens in the long run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompts", choices=("distinct", "same"), default="distinct",
                    help="one prompt per sequence, or one prompt for all B")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35,
                    help="vLLM's share of GPU memory: raise it for a whole model (weights + KV cache)")


def workload_argv(a: argparse.Namespace) -> list[str]:
    """The WORKLOAD_ARGS of a parsed namespace as command-line arguments for this script."""
    return [x for k in WORKLOAD_ARGS for x in ("--" + k.replace("_", "-"), str(getattr(a, k)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    add_workload_args(ap)
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, profile one short and one long generate per B")
    ap.add_argument("--keep-traces", type=Path, default=None,
                    help="with --profile: keep the traces (Chrome/Perfetto format) in this directory")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    env, kwargs = VARIANTS[a.variant]
    os.environ.update(env)                 # before vLLM is imported: plugins load on import
    batches = [int(b) for b in a.batches.split(",")]
    t0 = time.perf_counter()
    import vllm  # noqa: F401  (timed apart: the import is a large part of an engine start)
    import_s = time.perf_counter() - t0
    trace_dir = None
    if a.profile:
        import decode_profile

        trace_dir = decode_profile.new_trace_dir()
    llm = make_llm(a.model, a.variant, batches, a.prompt_len + max(a.long, a.short) + 16,
                   a.gpu_memory_utilization,
                   decode_profile.engine_kwargs(trace_dir) if trace_dir else {})
    start_s = time.perf_counter() - t0
    log(f"engine up in {start_s:.1f} s, {import_s:.1f} s of it importing vLLM "
        f"({a.variant}: {env} {kwargs})")
    result: dict[str, Any] = {"variant": a.variant, "model": a.model, "pid": os.getpid(),
                              "start_s": start_s, "import_s": import_s, "env": env,
                              "engine_kwargs": kwargs,
                              "short": a.short, "long": a.long, "reps": a.reps,
                              "prompt_len": a.prompt_len, "prompts": a.prompts,
                              "temperature": a.temperature,
                              "kernel_config_dir": os.environ.get("MOE_SERVE_KERNEL_CONFIG_DIR")}
    result["rows"] = measure(llm, batches, a.short, a.long, a.reps, a.prompt_len,
                             a.prompts == "distinct", a.temperature)
    a.out.write_text(json.dumps(result, indent=1))
    if trace_dir is not None:          # the timed rows are on disk first: a failed profile keeps them
        try:
            result["profile"] = profile(llm, trace_dir, batches, a.short, a.long, a.prompt_len,
                                        a.prompts == "distinct", a.temperature, a.keep_traces)
        except Exception as e:  # noqa: BLE001  (the profile is an extra; its failure is recorded)
            log(f"profile failed: {type(e).__name__}: {e}")
            result["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
