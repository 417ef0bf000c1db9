"""`moe-serve` / `python -m moe_serve.service`: parse flags (env vars as defaults), build the model, run uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from moe_serve.service.settings import DEFAULT_REQUEST_TIMEOUT_S, EXECUTOR_BACKENDS, Settings, SettingsError, env_default

KEEP_ALIVE_S = 75  # seconds an idle HTTP connection is kept open
SUBCOMMANDS = """subcommands (each has its own --help):
  moe-serve tune --model DIR [--tensor-parallel-size N]      tune the MoE and dense kernels for a model on this GPU
  moe-serve bench serve|kernels|tables ...                  benchmarks: against `vllm serve` over HTTP, the kernels
                                                            against vLLM's, the results' tables
  moe-serve explain --model DIR [--device NAME]             which kernel and config serve each MoE shape and M
                                                            (on another machine: --device and --triton-version of the target)
"""


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg expects KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def _timeout(text: str | float | None) -> float | None:
    """Seconds; `0`, `none` or `off` mean no timeout."""
    if text is None or str(text).strip().lower() in ("", "0", "none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, 0 or 'none', got {text!r}") from None
    return None if value == 0 else value


def _env_switch(name: str) -> bool | None:
    """MOE_SERVE_<NAME> as on (1/true/yes/on) or off (0/false/no/off); None when unset."""
    text = env_default(name)
    if text is None:
        return None
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"MOE_SERVE_{name.upper()} must be 1/true/yes/on or 0/false/no/off, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    e = env_default
    p = argparse.ArgumentParser(prog="moe-serve", description="OpenAI-compatible server for MoE models on vLLM. "
                                "Every flag also reads MOE_SERVE_<FLAG> from the environment.",
                                epilog=SUBCOMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=e("model"), help="local HF model dir or hub id (default: embedded tiny Mixtral)")
    p.add_argument("--served-model-name", default=e("served_model_name"))
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=e("tensor_parallel_size"),
                   help="default: all visible GPUs (at most 8); 1 on CPU")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=int(e("pipeline_parallel_size", 1)),
                   help="pipeline stages (default 1); stages can sit on different nodes with the ray backend")
    p.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                   default=e("distributed_executor_backend"),
                   help="vLLM's executor: mp (worker processes on this node; vLLM's default), ray (workers "
                   "on the nodes of a running Ray cluster: one replica over several nodes), uni (one process)")
    p.add_argument("--dtype", default=e("dtype", "auto"))
    p.add_argument("--max-model-len", type=int, default=e("max_model_len"))
    p.add_argument("--quantization", default=e("quantization"))
    p.add_argument("--gpu-memory-utilization", type=float, default=e("gpu_memory_utilization"),
                   help="fraction of GPU memory for weights+KV (default 0.9; on CPU a fixed 512 MiB KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=e("max_num_seqs"))
    p.add_argument("--moe-kernels", choices=["optimized", "vllm"], default=e("moe_kernels", "optimized"),
                   help="optimized: moe-serve's Triton MoE kernels; vllm: stock vLLM (for A/B)")
    p.add_argument("--fused-router", action=argparse.BooleanOptionalAction, default=_env_switch("fused_router"),
                   help="a MoE layer's gate GEMM + top-k at small decode batches in one launch of ours, where "
                   "vLLM's runner holds the gate (Qwen3-MoE style; Mixtral's is moved there); default on with "
                   "--moe-kernels optimized")
    p.add_argument("--dense-gemv", action=argparse.BooleanOptionalAction, default=_env_switch("dense_gemv"),
                   help="the dense GEMMs of unquantized layers (QKV, O, MLP, lm_head) at 1..8 tokens on "
                   "moe-serve's split-K GEMV (kernels/dense/) instead of cuBLAS, for the shapes and token "
                   "counts where a tuned table for the GPU lists it (measured faster; "
                   "`moe-serve tune --model DIR` makes tables); default on with --moe-kernels optimized")
    p.add_argument("--expert-stats", action=argparse.BooleanOptionalAction, default=_env_switch("expert_stats"),
                   help="count the tokens routed to each expert of each MoE layer on the GPU, in every worker, "
                   "for /metrics (per layer) and GET /v1/moe/expert-load (layer x expert); default on")
    p.add_argument("--expert-stats-window", type=float, default=float(e("expert_stats_window", 60.0)),
                   help="seconds of the expert load's sliding window (imbalance, idle experts; default 60)")
    p.add_argument("--host", default=e("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(e("port", 8000)))
    p.add_argument("--api-key", action="append", default=None,
                   help="bearer key required on every route but /health and /ping (repeat for several; "
                   "env MOE_SERVE_API_KEY, comma-separated)")
    p.add_argument("--metrics-api-key", default=e("metrics_api_key"),
                   help="bearer key for /metrics instead of the API key")
    p.add_argument("--enable-docs", action="store_true", default=e("enable_docs", "0") in ("1", "true"),
                   help="serve /docs, /redoc and /openapi.json (behind the API key when one is set); default off")
    p.add_argument("--tune-on-start", action="store_true",
                   default=e("tune_on_start", "0") in ("1", "true"),
                   help="before serving, run `moe-serve tune` for MoE shapes with no tuned table for "
                   "this GPU (results cached for the next start); default off")
    p.add_argument("--tune-budget-minutes", type=float, default=float(e("tune_budget_minutes", 10)),
                   help="time budget of --tune-on-start (default 10)")
    p.add_argument("--forwarded-allow-ips", default=e("forwarded_allow_ips"),
                   help="comma-separated proxy addresses (or '*') whose X-Forwarded-For/-Proto are trusted; "
                   "default: proxy headers are ignored")
    p.add_argument("--engine-arg", action="append", type=_engine_arg, default=[], metavar="KEY=VALUE",
                   help="extra vLLM AsyncEngineArgs field (value parsed as JSON if it can be), repeatable")
    p.add_argument("--max-concurrent-requests", type=int, default=int(e("max_concurrent_requests", 256)))
    p.add_argument("--max-queued-requests", type=int, default=int(e("max_queued_requests", 1024)))
    p.add_argument("--max-prompt-tokens-in-flight", type=int, default=e("max_prompt_tokens_in_flight"))
    p.add_argument("--max-request-bytes", type=int, default=int(e("max_request_bytes", 4 * 1024 * 1024)))
    p.add_argument("--max-n", type=int, default=int(e("max_n", 16)))
    p.add_argument("--max-tokens-limit", type=int, default=e("max_tokens_limit"))
    p.add_argument("--max-stop-sequences", type=int, default=int(e("max_stop_sequences", 8)))
    p.add_argument("--max-batch-prompts", type=int, default=int(e("max_batch_prompts", 128)),
                   help="most prompts in one /v1/completions request (400 beyond)")
    p.add_argument("--max-messages", type=int, default=int(e("max_messages", 1024)),
                   help="most messages in one chat request (400 beyond)")
    p.add_argument("--default-max-tokens", type=int, default=int(e("default_max_tokens", 4096)),
                   help="output cap for requests that set no max_tokens; 0: up to the context length")
    p.add_argument("--max-structured-output-bytes", type=int, default=int(e("max_structured_output_bytes", 65536)),
                   help="largest JSON schema, regex, grammar, choice list or structural tag of one request, in "
                   "bytes (400 beyond)")
    p.add_argument("--max-structured-output-choices", type=int,
                   default=int(e("max_structured_output_choices", 4096)),
                   help="most enum values (summed over a schema) or choices in one constraint (400 beyond)")
    p.add_argument("--structured-output-compile-budget", type=float,
                   default=float(e("structured_output_compile_budget", 3.0)),
                   help="CPU seconds a constraint may take to convert into a grammar (as vLLM's xgrammar "
                   "backend does), measured before the engine sees it (400 beyond)")
    p.add_argument("--structured-output-checkers", type=int, default=int(e("structured_output_checkers", 2)),
                   help="constraints checked at once")
    p.add_argument("--max-header-bytes", type=int, default=int(e("max_header_bytes", 65536)),
                   help="request line and headers, in bytes (431 beyond)")
    p.add_argument("--header-timeout", type=float, default=float(e("header_timeout", 30.0)),
                   help="seconds a request's headers may take to arrive (408, connection closed)")
    p.add_argument("--body-timeout", type=float, default=float(e("body_timeout", 60.0)),
                   help="seconds a request's whole body may take to arrive (408)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   default=e("enable_auto_tool_choice", "0") in ("1", "true"),
                   help="as in vllm serve (default on for the embedded model)")
    p.add_argument("--tool-call-parser", default=e("tool_call_parser"),
                   help="a vLLM tool parser name, as in vllm serve (embedded model: hermes)")
    p.add_argument("--reasoning-parser", default=e("reasoning_parser"), help="a vLLM reasoning parser name")
    p.add_argument("--chat-template", default=e("chat_template"), help="chat template file or string")
    p.add_argument("--frontend-arg", action="append", default=[], metavar="FLAG",
                   help="another `vllm serve` frontend flag, passed to vLLM's OpenAI layer as given "
                        "(repeatable; e.g. --frontend-arg=--return-tokens-as-token-ids)")
    p.add_argument("--drain-timeout", type=float, default=float(e("drain_timeout", 30.0)),
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--malloc-trim-interval", type=float, default=float(e("malloc_trim_interval", 60.0)),
                   help="seconds between returns of freed heap memory to the OS (glibc malloc_trim); 0 disables")
    p.add_argument("--request-timeout", type=_timeout, default=e("request_timeout", f"{DEFAULT_REQUEST_TIMEOUT_S:g}"),
                   help=f"abort a request after this many seconds (408 / final error event); default "
                   f"{DEFAULT_REQUEST_TIMEOUT_S:g}; 0 or 'none' disables")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   default=e("access_log", "1") not in ("0", "false"))
    p.add_argument("--access-log-json", action="store_true", default=e("access_log_json", "0") in ("1", "true"),
                   help="one JSON object per request line (no prompt text, no keys)")
    p.add_argument("--log-level", default=e("log_level", "info"))
    return p


def settings_from_args(argv: list[str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    keys = args.api_key or [k for k in (env_default("api_key") or "").split(",") if k]
    opt_int = lambda v: None if v in (None, "") else int(v)  # noqa: E731 - env values arrive as strings
    opt_float = lambda v: None if v in (None, "") else float(v)  # noqa: E731
    return Settings(
        model=args.model, served_model_name=args.served_model_name,
        tensor_parallel_size=opt_int(args.tensor_parallel_size), pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend or None, dtype=args.dtype,
        max_model_len=opt_int(args.max_model_len), quantization=args.quantization,
        gpu_memory_utilization=opt_float(args.gpu_memory_utilization),
        max_num_seqs=opt_int(args.max_num_seqs),
        moe_kernels=args.moe_kernels, fused_router=args.fused_router, dense_gemv=args.dense_gemv,
        host=args.host, port=args.port,
        expert_stats=args.expert_stats is not False, expert_stats_window_s=args.expert_stats_window,
        api_keys=tuple(keys),
        metrics_api_key=args.metrics_api_key, engine_args=dict(args.engine_arg),
        max_concurrent_requests=args.max_concurrent_requests, max_queued_requests=args.max_queued_requests,
        max_prompt_tokens_in_flight=opt_int(args.max_prompt_tokens_in_flight),
        max_request_bytes=args.max_request_bytes, max_n=args.max_n,
        max_tokens_limit=opt_int(args.max_tokens_limit), max_stop_sequences=args.max_stop_sequences,
        max_batch_prompts=args.max_batch_prompts, max_messages=args.max_messages,
        default_max_tokens=args.default_max_tokens or None,
        max_structured_output_bytes=args.max_structured_output_bytes,
        max_structured_output_choices=args.max_structured_output_choices,
        structured_output_compile_budget_s=args.structured_output_compile_budget,
        structured_output_checkers=args.structured_output_checkers, max_header_bytes=args.max_header_bytes,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template, frontend_args=tuple(args.frontend_arg),
        drain_timeout_s=args.drain_timeout, malloc_trim_interval_s=args.malloc_trim_interval,
        log_level=args.log_level,
        request_timeout_s=args.request_timeout, access_log=args.access_log, access_log_json=args.access_log_json,
        enable_docs=args.enable_docs, forwarded_allow_ips=args.forwarded_allow_ips or None,
        tune_on_start=args.tune_on_start, tune_budget_minutes=args.tune_budget_minutes,
    ).validated()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["tune"]:                      # moe-serve tune ... (moe_serve.kernels.tuning.tune_cli)
        from moe_serve.bench.experts.run import tune_dense
        from moe_serve.kernels.tuning.tune_cli import main as tune_main

        return tune_main(args[1:], dense=tune_dense)
    if args[:1] == ["bench"]:                     # moe-serve bench serve|kernels|tables ... (moe_serve.bench.cli)
        from moe_serve.bench.cli import main as bench_main

        return bench_main(args[1:])
    if args[:1] == ["explain"]:                   # moe-serve explain ... (moe_serve.kernels.tuning.explain)
        from moe_serve.kernels.tuning.explain import main as explain_main

        return explain_main(args[1:])
    try:
        settings = settings_from_args(argv)
    except SettingsError as exc:
        print(f"moe-serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from moe_serve.service.app import create_app
    from moe_serve.service.embedded_model import ensure_embedded_model
    from moe_serve.service.engine import default_engine_env, kernel_plugin_installed
    from moe_serve.service.http_protocol import guarded_protocol
    from moe_serve.service.shutdown import ABORT_FLUSH_S, DrainingServer

    default_engine_env(embedded_model=settings.model is None)
    if settings.moe_kernels == "optimized" and not kernel_plugin_installed():
        # Seen on the H200: run from a source tree, vLLM never loaded our kernels and the
        # "optimized" server silently served stock vLLM. Refuse instead.
        print("moe-serve: error: --moe-kernels optimized needs moe-serve installed (pip install -e . or "
              "pip install --target DIR .) so vLLM finds its 'vllm.general_plugins' entry point; "
              "or pass --moe-kernels vllm", file=sys.stderr)
        return 2
    model_path = settings.model or str(ensure_embedded_model())
    app = create_app(settings, model_path)
    # Keep idle connections longer than clients and load balancers do (httpx: 5 s, typical LBs: 60 s).
    # uvicorn's default 5 s equals httpx's pool expiry: suspected cause of the 4 ReadErrors in 12,541
    # requests of the first 2026-11-29 soak; the re-run (also pinned, idle machine) had 0 in 22,321.
    # Proxy headers (X-Forwarded-For/-Proto) rewrite the client address: honoured only from the
    # proxies --forwarded-allow-ips names (uvicorn would trust 127.0.0.1 by default). The HTTP
    # protocol is uvicorn's httptools one with header size and time limits (service/http_protocol.py).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=ABORT_FLUSH_S, timeout_keep_alive=KEEP_ALIVE_S,
                            access_log=False, proxy_headers=settings.forwarded_allow_ips is not None,
                            forwarded_allow_ips=settings.forwarded_allow_ips,
                            http=guarded_protocol(settings.max_header_bytes, settings.header_timeout_s))
    DrainingServer(config, app.state.server).run()
    # The engine and its workers are shut down by now. Skip interpreter teardown of torch
    # and vLLM (15+ s on a loaded machine, with noisy __del__ errors): flush and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(app.state.server.exit_code)


if __name__ == "__main__":
    sys.exit(main())
