"""Our HTTP frontend vs vLLM's own OpenAI server, same engine, same tiny model, same run.

Starts `python -m vllm.entrypoints.openai.api_server` on the embedded model (vLLM CPU engine),
drives it with the closed-loop streaming `step` sweep (`loadtest run --engine asyncio`;
concurrency 1, 2, 4, ..., --max-users), stops it, does the same with `python -m service`, then
prints the ratio table (B = moe-serve over A = vLLM). Usage (CPU, ~6 min):

    .venv/bin/python bench/frontend_vs_vllm.py --out /tmp/frontend --max-users 64 --step-seconds 10
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.embedded_model import ensure_embedded_model  # noqa: E402
from tests.server_proc import MODEL_NAME, free_port, start_server  # noqa: E402


def start_vllm(model_dir: Path, log_dir: Path, timeout: float) -> tuple[subprocess.Popen, str, float]:
    """vLLM's own OpenAI server on the same model and KV budget as ours; returns (proc, url, start s)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL_NAME, "--port", str(port), "--kv-cache-memory-bytes", str(512 * 1024 ** 2),
           "--no-enable-log-requests"]
    began = time.monotonic()
    log = open(log_dir / "vllm-api-server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM api_server exited {proc.returncode}; see {log_dir}/vllm-api-server.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("vLLM api_server not ready")


def sweep(url: str, label: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "loadtest", "run", "--engine", "asyncio", "--scenario", "step", "--host", url,
           "--label", label, "--model", MODEL_NAME, "--max-users", str(args.max_users),
           "--step-seconds", str(args.step_seconds), "--max-tokens", str(args.max_tokens), "--no-plots",
           "--out", str(args.out / label)]
    return subprocess.run(cmd, cwd=REPO).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-users", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ready-timeout", type=float, default=400)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_embedded_model()
    # One server at a time: an idle vLLM CPU engine still holds its OpenMP threads, and on a
    # 2-core machine a second engine beside the measured one skews the comparison.
    vllm_proc, vllm_url, vllm_start = start_vllm(model_dir, args.out, args.ready_timeout)
    try:
        rc_a = sweep(vllm_url, "vllm-api-server", args)
    finally:
        vllm_proc.terminate()
        vllm_proc.wait(60)
    began = time.monotonic()
    ours = start_server(args.out, ready_timeout=args.ready_timeout)
    ours_start = time.monotonic() - began
    try:
        rc_b = sweep(ours.base_url, "moe-serve", args)
    finally:
        ours.stop()
    print(f"ready: vLLM api_server {vllm_start:.1f} s, moe-serve {ours_start:.1f} s", flush=True)
    cmd = [sys.executable, "-m", "loadtest", "compare", str(args.out / "vllm-api-server"), str(args.out / "moe-serve"),
           "--label-a", "vllm-api-server", "--label-b", "moe-serve", "--out", str(args.out / "ab")]
    return rc_a or rc_b or subprocess.run(cmd, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
