# Source on the H200 host from the repo root: vLLM 0.26 from the offline bundle, moe-serve
# installed (vLLM finds the kernel plugin only through an installed entry point), server env.
#
#   source bench/device_env.sh || exit 1
#
# The bundle parts must already be in /root/dbundle, or in .dbundle/ (carried) of this call;
# ../shared/device/README.md says how to send them. Idempotent: a second call on the same
# machine only re-installs moe-serve (seconds).
if [ -d .dbundle ]; then
  mkdir -p /root/dbundle && cp .dbundle/* /root/dbundle/ || return 1
fi
eval "$(bash /root/dbundle/install.sh)" || return 1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /opt/ms . || return 1
export PYTHONPATH=/opt/ms:$PYTHONPATH HF_HUB_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
python3 -c "import vllm, triton, torch; print('device env: vllm', vllm.__version__, 'triton', triton.__version__,
'torch', torch.__version__, torch.cuda.get_device_name())" || return 1
