"""One validated settings object for the server, filled from CLI flags and env vars."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from moe_serve.kernels.config import KEY as PLUGIN_KEY
from moe_serve.kernels.config import PluginConfig, PluginConfigError, env_name

MoeKernels = Literal["optimized", "vllm"]
MAX_TENSOR_PARALLEL = 8  # one node's GPUs; over several nodes (executor backend ray) there is no cap
EXECUTOR_BACKENDS = ("mp", "ray", "uni")  # vLLM's distributed_executor_backend values a server can use
EMBEDDED_MODEL_NAME = "moe-serve-tiny-mixtral"
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class SettingsError(ValueError):
    """A setting is out of range or inconsistent; the message names the flag."""


def visible_gpu_count() -> int:
    """Number of CUDA devices this process can see (0 on CPU-only machines)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" here
        return 0


@dataclass(frozen=True)
class Settings:
    """Everything the server needs to start. Validate with `validated()`."""

    model: str | None = None  # None: the embedded tiny Mixtral
    served_model_name: str | None = None
    tensor_parallel_size: int | None = None  # None: all visible GPUs (max 8), 1 on CPU
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: vLLM's choice (mp on one node); ray: a Ray cluster
    dtype: str = "auto"
    max_model_len: int | None = None
    quantization: str | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on GPU; a fixed KV budget on CPU
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int | None = None
    moe_kernels: MoeKernels = "optimized"
    fused_router: bool | None = None  # kernels/plugin/router_hook.py in every worker; None: on with optimized
    dense_gemv: bool | None = None  # kernels/plugin/dense_hook.py in every worker; None: on with optimized
    expert_stats: bool = True  # per-layer expert load counted in the workers (kernels/plugin/expert_load.py)
    expert_stats_window_s: float = 60.0  # its sliding window (service/expert_load.py)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    metrics_api_key: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)  # pass-through to AsyncEngineArgs
    # Admission control and input limits.
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    max_prompt_tokens_in_flight: int | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_tokens_limit: int | None = None  # cap on max_tokens per request (None: context length)
    max_stop_sequences: int = 8
    max_batch_prompts: int = 128  # prompts in one /v1/completions request
    max_messages: int = 1024  # messages in one chat request
    default_max_tokens: int | None = 4096  # output cap for requests that set none (None: the context)
    # What one structured-output constraint (json schema, regex, grammar, choice list, structural
    # tag, the tools of a `required`/named tool_choice) may cost, checked before the engine sees it
    # (service/structured_limits.py): its size in bytes, its enum values + choices, and the time
    # xgrammar takes to convert and compile it for this model's vocabulary, measured in a
    # checker process that kills a compile past the budget (service/grammar_worker.py).
    max_structured_output_bytes: int = 64 * 1024
    max_structured_output_choices: int = 4096
    structured_output_compile_budget_s: float = 3.0
    structured_output_checkers: int = 2  # compiles measured at once
    # HTTP connections (service/http_protocol.py, service/middleware.py).
    max_header_bytes: int = 64 * 1024  # request line + headers; beyond: 431
    header_timeout_s: float = 30.0  # a request's headers must arrive within this (slowloris: 408, closed)
    body_timeout_s: float = 60.0  # a request's whole body must arrive within this (408)
    # vLLM's OpenAI layer (service/vllm_compat.py): `vllm serve` flags of the same names.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # with the embedded model: hermes (and auto tool choice)
    reasoning_parser: str | None = None
    chat_template: str | None = None
    frontend_args: tuple[str, ...] = ()  # further `vllm serve` frontend flags, passed as given
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S  # None: no timeout
    tune_on_start: bool = False  # run `moe-serve tune` for untuned MoE shapes before serving
    tune_budget_minutes: float = 10.0
    drain_timeout_s: float = 30.0
    malloc_trim_interval_s: float = 60.0  # 0 disables (service/memory_trim.py)
    log_level: str = "info"
    access_log: bool = True
    access_log_json: bool = False
    enable_docs: bool = False  # /docs, /redoc, /openapi.json (behind the API key when one is set)
    forwarded_allow_ips: str | None = None  # trusted proxies for X-Forwarded-*; None: proxy headers off

    @property
    def model_name(self) -> str:
        """The name clients must send in `model`: --served-model-name, else the model directory's
        name (never its path), a hub id as given, or the embedded model's name."""
        if self.served_model_name:
            return self.served_model_name
        if not self.model:
            return EMBEDDED_MODEL_NAME
        if _is_local_path(self.model):
            return os.path.basename(os.path.abspath(os.path.expanduser(self.model))) or EMBEDDED_MODEL_NAME
        return self.model

    @property
    def uses_fused_router(self) -> bool:
        """The workers run moe-serve's one-launch router where a layer is eligible: with our
        kernels, unless turned off (--no-fused-router)."""
        return self.moe_kernels == "optimized" and self.fused_router is not False

    @property
    def uses_dense_gemv(self) -> bool:
        """The workers route the unquantized linear layers and the lm_head at 1..8 tokens to
        moe-serve's dense decode GEMV where a tuned table lists the shape for the GPU: with our
        kernels, unless turned off (--no-dense-gemv)."""
        return self.moe_kernels == "optimized" and self.dense_gemv is not False

    def validated(self) -> "Settings":
        """Return self if every field is in range, else raise SettingsError."""
        tp = self.tensor_parallel_size
        if self.tune_budget_minutes <= 0:
            raise SettingsError(f"--tune-budget-minutes must be > 0, got {self.tune_budget_minutes}")
        backend = self.executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise SettingsError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                                f"got {backend!r}")
        if tp is not None and (tp < 1 or (tp > MAX_TENSOR_PARALLEL and backend != "ray")):
            raise SettingsError(f"--tensor-parallel-size must be in 1..{MAX_TENSOR_PARALLEL} (more only over "
                                f"several nodes, with --distributed-executor-backend ray), got {tp}")
        if self.pipeline_parallel_size < 1:
            raise SettingsError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise SettingsError("--gpu-memory-utilization must be in (0, 1]")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"--port must be in 0..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise SettingsError("--max-model-len must be >= 16")
        if self.moe_kernels not in ("optimized", "vllm"):
            raise SettingsError(f"--moe-kernels must be 'optimized' or 'vllm', got {self.moe_kernels!r}")
        if self.fused_router is True and self.moe_kernels != "optimized":
            raise SettingsError("--fused-router runs moe-serve's router: it needs --moe-kernels optimized")
        if self.dense_gemv is True and self.moe_kernels != "optimized":
            raise SettingsError("--dense-gemv runs moe-serve's dense GEMV: it needs --moe-kernels optimized")
        for name in ("max_concurrent_requests", "max_queued_requests", "max_request_bytes", "max_n",
                     "max_stop_sequences", "max_batch_prompts", "max_messages", "max_structured_output_bytes",
                     "max_structured_output_choices", "structured_output_checkers", "max_header_bytes"):
            if getattr(self, name) < 1 and name != "max_queued_requests":
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_queued_requests < 0:
            raise SettingsError("--max-queued-requests must be >= 0")
        if any(not key for key in self.api_keys):
            raise SettingsError("API keys must be non-empty")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise SettingsError("--default-max-tokens must be >= 1 (0 on the command line: no cap)")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise SettingsError("--request-timeout must be > 0")
        if self.drain_timeout_s < 0:
            raise SettingsError("--drain-timeout must be >= 0")
        for name in ("structured_output_compile_budget_s", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")
        if self.expert_stats_window_s <= 0:
            raise SettingsError("--expert-stats-window must be > 0")
        if self.malloc_trim_interval_s < 0:
            raise SettingsError("--malloc-trim-interval must be >= 0 (0 disables)")
        self.plugin_config()
        return self

    def plugin_config(self) -> PluginConfig:
        """The engine's plugin settings (kernels/config.py), passed as additional_config["moe_serve"]:
        the flags' choices, and for the settings without a flag the --engine-arg additional_config's
        "moe_serve" over MOE_SERVE_* over the defaults. Raises SettingsError naming a bad setting."""
        flags = {"mode": self.moe_kernels, "fused_router": self.uses_fused_router,
                 "dense_gemv": self.uses_dense_gemv, "expert_stats": self.expert_stats,
                 "expert_stats_window_s": self.expert_stats_window_s}
        extra = self.engine_args.get("additional_config") or {}
        given = extra.get(PLUGIN_KEY, {}) if isinstance(extra, Mapping) else {}
        if isinstance(given, Mapping) and set(given) & set(flags):
            name = sorted(set(given) & set(flags))[0]
            raise SettingsError(f"additional_config['{PLUGIN_KEY}']['{name}']: set it with its flag "
                                f"({FLAG_OF[name]}) or {env_name(name)}")
        try:
            merged = {**given, **flags} if isinstance(given, Mapping) else given
            return PluginConfig.from_vllm({PLUGIN_KEY: merged})
        except PluginConfigError as exc:
            raise SettingsError(str(exc)) from None

    @property
    def executor_backend(self) -> str | None:
        """vLLM's executor backend: --distributed-executor-backend, or the same key given with
        --engine-arg (which wins, as every pass-through arg does)."""
        return self.engine_args.get("distributed_executor_backend", self.distributed_executor_backend)

    def resolved_tensor_parallel_size(self) -> int:
        """TP size to start with: the flag, else all visible GPUs (<= 8), else 1."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        return max(1, min(visible_gpu_count(), MAX_TENSOR_PARALLEL))


FLAG_OF = {"mode": "--moe-kernels", "fused_router": "--fused-router / --no-fused-router",
           "dense_gemv": "--dense-gemv / --no-dense-gemv", "expert_stats": "--expert-stats / --no-expert-stats",
           "expert_stats_window_s": "--expert-stats-window"}


def _is_local_path(model: str) -> bool:
    """A filesystem path (existing, or spelled as one) rather than a hub id like `org/name`."""
    return model.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(model))


def env_default(name: str, default: Any = None) -> Any:
    """`MOE_SERVE_<NAME>` from the environment, or `default`."""
    return os.environ.get("MOE_SERVE_" + name.upper().replace("-", "_"), default)
