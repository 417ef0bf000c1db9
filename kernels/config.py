"""moe-serve's plugin settings: one validated, frozen `PluginConfig` per process.

Where the settings come from, the same under moe-serve and under `vllm serve` + the plugin:

1. ``vllm_config.additional_config["moe_serve"]`` (a dict of the fields below): what moe-serve's
   server passes its engine (service/engine.py, from its flags), or what a user passes with
   ``vllm serve --additional-config '{"moe_serve": {"dense_gemv": false}}'``;
2. for a field that dict does not set, the environment variable ``MOE_SERVE_<FIELD>`` (the field
   name upper-cased; two keep the names of the moe-serve flags they always had: ``mode`` is
   ``MOE_SERVE_MOE_KERNELS``, ``expert_stats_window_s`` is ``MOE_SERVE_EXPERT_STATS_WINDOW``); an
   empty value counts as unset;
3. else the field's default.

The explicit config wins over the environment, as moe-serve's flags win over their
``MOE_SERVE_*`` defaults: moe-serve resolves flags and environment in its API process and passes
every field, so an engine process's environment cannot undo a flag. A bad value (an unknown
key, a value outside a field's allowed values) raises `PluginConfigError` naming the setting,
where it came from and the allowed values: in moe-serve's API process before the engine starts,
and under `vllm serve` when a worker starts.

The plugin builds the config once per worker (`from_vllm` at worker init) and `configure`s it;
the per-layer plans are built from it, and the hot path reads those, never the environment.
Outside a vLLM worker (the CLI tools, tests) `current()` builds it from the environment at the
call.

Process plumbing, not settings (read where they are used, never passed in additional_config):
``MOE_SERVE_VLLM_PLUGIN`` (the opt-in: "1" makes the plugin patch this vLLM process; moe-serve
exports it for its engine), ``MOE_SERVE_VLLM_PINS_WARNED`` (a process already warned of failed
pins) and ``MOE_SERVE_RUNTIME_DIR`` (the dir the API process created for the workers' metrics
files). This module imports neither torch nor triton, so every layer of kernels/ may import it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

KEY = "moe_serve"              # additional_config[KEY]
ENV_PREFIX = "MOE_SERVE_"
BOOL = "true/false (also 1/0, yes/no, on/off)"


def _setting(default: Any, doc: str, allowed: str, **limits: Any) -> Any:
    return Field(default, description=doc, json_schema_extra={"allowed": allowed}, **limits)


class PluginConfigError(ValueError):
    """A plugin setting with a bad value or an unknown name; the message names the setting, its
    source and the allowed values."""


class PluginConfig(BaseModel):
    """Every setting of moe-serve's vLLM plugin (see the module doc for where each comes from)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["optimized", "vllm"] = _setting(
        "optimized", "optimized: moe-serve's kernels where the layer plans choose them; vllm: install no kernel "
        "hook (stock vLLM, for A/B)", "optimized, vllm")
    fused_router: bool = _setting(
        True, "a MoE layer's gate GEMM + top-k at decode in one launch of ours (kernels/plugin/router_hook.py), "
        "in optimized mode", BOOL)
    dense_gemv: bool = _setting(
        True, "unquantized linear layers and the lm_head at 1..8 tokens on our dense GEMV where a tuned table "
        "lists the shape (kernels/plugin/dense_hook.py), in optimized mode", BOOL)
    expert_stats: bool = _setting(
        True, "count the tokens routed to each expert of each MoE layer on the device (kernels/plugin/expert_load.py)",
        BOOL)
    expert_stats_window_s: float = _setting(
        60.0, "seconds of the expert load's sliding window", "a number of seconds > 0", gt=0, allow_inf_nan=False)
    moe_routing: Literal["table", "ours", "vllm"] = _setting(
        "table", "which MoE kernel serves each M: the routing tables (table), ours wherever the layer supports it, "
        "or vLLM's always (A/B runs, tests)", "table, ours, vllm")
    block_pdl: bool = _setting(
        False, "chain the whole MoE block at decode by programmatic dependent launch (router and up kernel too, "
        "sm_90+)", BOOL)
    vllm_warmup_max_calls: int = _setting(
        4096, "most calls of vLLM's MoE kernel per layer shape in the plugin's warm-up", "an integer >= 0", ge=0)
    kernel_config_dir: str | None = _setting(
        None, "a dir of kernel tables searched before the tuner's cache and the shipped tables", "a directory path",
        min_length=1)
    cache: str | None = _setting(
        None, "moe-serve's cache root; `moe-serve tune` writes tables under kernels/<GPU>/triton-<version> "
        "(default ~/.cache/moe-serve)", "a directory path", min_length=1)
    fuse_norm_gemv: bool = _setting(
        False, "residual add + RMSNorm in the prologue of the QKV decode GEMV at 1..16 tokens (our model classes, "
        "kernels/models: Qwen3-MoE, Mixtral), at the token counts its tuned norm_gemv table lists", BOOL)
    fuse_qk_norm_rope: bool = _setting(
        False, "Qwen3-MoE's per-head Q/K RMSNorm + RoPE in one kernel (our model class)", BOOL)
    fp8_dense_gemv: bool = _setting(
        False, "FP8 linear layers (per-tensor, per-channel, block) at 1..16 tokens on our weight-streaming GEMV "
        "where a tuned table lists the shape (kernels/plugin/fp8_dense_hook.py)", BOOL)
    decode_attention: bool = _setting(
        False, "decode batches' attention on our one-launch paged decode kernel instead of vLLM's FlashAttention "
        "(kernels/plugin/attention_hook.py), in optimized mode", BOOL)
    fp8_moe_gemv: bool = _setting(
        False, "FP8 MoE layers at 1..16 tokens on our CUDA-core decode path (FP8 weights dequantized in "
        "registers; the layer plan's buckets 1..16)", BOOL)

    @classmethod
    def from_vllm(cls, additional_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None) -> "PluginConfig":
        """The config of a vLLM engine: additional_config["moe_serve"] over the environment's
        (default: this process's) MOE_SERVE_<FIELD> over the defaults. Raises PluginConfigError
        naming the bad setting."""
        environ = os.environ if environ is None else environ
        given = (additional_config or {}).get(KEY)
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise PluginConfigError(f"additional_config[{KEY!r}] must be a dict of moe-serve settings, "
                                    f"got {type(given).__name__}")
        unknown = sorted(set(given) - set(cls.model_fields))
        if unknown:
            raise PluginConfigError(f"additional_config[{KEY!r}]: unknown setting(s) {', '.join(map(repr, unknown))}; "
                                    f"the settings are {', '.join(cls.model_fields)}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name in cls.model_fields:
            if name in given:
                values[name], sources[name] = given[name], f"additional_config[{KEY!r}][{name!r}]"
            elif environ.get(env_name(name), "").strip():
                values[name], sources[name] = environ[env_name(name)].strip(), env_name(name)
        return cls.build(values, sources)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PluginConfig":
        """The environment's settings alone (no vLLM config at hand)."""
        return cls.from_vllm(None, environ)

    @classmethod
    def build(cls, values: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> "PluginConfig":
        """Validate values; the first bad one raises PluginConfigError naming it (its source from
        `sources`, else its field name) and its allowed values."""
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "?"
            where = (sources or {}).get(name, name)
            allowed = allowed_values(name) if name in cls.model_fields else ", ".join(cls.model_fields)
            raise PluginConfigError(f"moe-serve setting {name} ({where}) = {values.get(name)!r} is not valid: "
                                    f"allowed: {allowed}") from None

    def additional_config(self) -> dict[str, dict[str, Any]]:
        """{"moe_serve": every field}: what moe-serve passes its engine as additional_config."""
        return {KEY: self.model_dump()}


def env_name(field: str) -> str:
    """The environment variable of a field (see the module doc)."""
    return _ENV_NAMES.get(field, ENV_PREFIX + field.upper())


def allowed_values(field: str) -> str:
    """A field's allowed values, in words."""
    extra = PluginConfig.model_fields[field].json_schema_extra
    return str(extra["allowed"]) if isinstance(extra, dict) else "?"


_ENV_NAMES = {"mode": "MOE_SERVE_MOE_KERNELS", "expert_stats_window_s": "MOE_SERVE_EXPERT_STATS_WINDOW"}
_configured: PluginConfig | None = None


def configure(config: PluginConfig | None) -> None:
    """Make `config` this process's (the plugin, once per worker); None forgets it."""
    global _configured
    _configured = config


def current() -> PluginConfig:
    """This process's config: the configured one, else the environment's at this call (CLI
    tools, tests; a bad value raises PluginConfigError)."""
    return _configured if _configured is not None else PluginConfig.from_env()
