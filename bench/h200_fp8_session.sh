#!/usr/bin/env bash
# One H200 session for the FP8-backend proof (issue 16) and tuning runs (issue 15), over the
# calls that carry the vLLM bundle (shared/device) back to back. The tree (~9 MB) plus one
# 55 MiB bundle part no longer fits one call's 64 MiB: split part00/part01 in two
# (`split -b 29M -d -a 1 .dbundle/part00 .dbundle/p00_`), carry one half per call and
# `cat` them into /root/dbundle/partNN. Everything a later step needs is written under $OUT
# as it is produced: a call killed at its time limit returns only what is under $OUT.
#   bash bench/h200_fp8_session.sh STAGE OUT
# 1 (part02 + .dev/fi: FlashInfer site + AOT fused_moe_90.so): host facts, FlashInfer into
#   /opt/fi-site, kernel correctness on the GPU (all paths, bf16/fp8)
# 2 (part00 + part01 halves delivered, installs vLLM): `moe-serve tune` of Mixtral-8x7B TP=2
#   and Qwen3-30B-A3B TP=1 with vLLM importable (its configs seed the search; see
#   kernels/tune_cli.seed_warning), then the three-way FP8 kernel table
# 3 (any later call): the FP8 decode A/B (stock vs moe-serve), resumable, then bf16
set -uo pipefail
stage=$1 out=$2
mkdir -p /root/tuned "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fi_env() {  # FlashInfer after vLLM's site on the path; nvcc on PATH (vLLM's has_flashinfer);
  # the CUDA 13 libraries the prebuilt module links (cudart, nvrtc) findable by the loader
  local nv; nv=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null)
  export PYTHONPATH=$PYTHONPATH:/opt/fi-site PATH=$PATH:/usr/local/cuda/bin
  export LD_LIBRARY_PATH=${nv:+$nv:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
tune() {  # model tp dtype budget_min
  local q=""; [[ $3 == fp8 ]] && q="--quantization fp8"
  local t0=$SECONDS
  python3 -m kernels.tune_cli --model "bench/models/$1" -tp "$2" $q --budget-minutes "$4" \
    --out /root/tuned 2>&1 | grep -v "^\[tune\] \[" | tee -a "$out/tune.log"
  echo "TUNE_TIME $1 tp$2 $3 with-vllm $((SECONDS - t0))s" | tee -a "$out/tune.log"
  tar -C /root -cf "$out/tuned.tar" tuned            # table names carry '=' and ','
}
dab() {  # variants quantization budget_s out_subdir
  mkdir -p "$out/dab-$4"; cp /root/dab-"$4"/run-* "$out/dab-$4/" 2>/dev/null
  python3 bench/decode_ab.py --model mixtral-8x7b-tp8-rank --quantization "$2" --variants "$1" \
    --processes 6 --budget-s "$3" --out "$out/dab-$4" 2>&1 | grep "decode_ab"
  rm -rf "$out/dab-$4/models"; mkdir -p /root/dab-"$4"; cp "$out/dab-$4"/run-* /root/dab-"$4"/
}
case $stage in
  1) { cat /etc/os-release | head -2; ldd --version | head -1; gcc --version | head -1
       which nvcc && nvcc --version | tail -2; nproc; nvidia-smi -L; } 2>&1 | tee "$out/host.txt"
     mkdir -p /opt/fi-site && tar -C /opt/fi-site -xJf .dev/fi/fi-site.tar.xz
     fi_env
     xz -dc .dev/fi/fused_moe_90.so.xz > /tmp/fused_moe_90.so
     if ! python3 bench/flashinfer_aot.py install --so /tmp/fused_moe_90.so 2>&1 | tee "$out/fi_install.log"; then
       echo "prebuilt module did not load: relinking the carried objects with this host's toolkit"
       mkdir -p /root/fiw && tar -C /root/fiw -xJf .dev/fi/objects.tar.xz
       FLASHINFER_WORKSPACE_BASE=/root/fiw CUDA_HOME=/usr/local/cuda python3 bench/flashinfer_aot.py \
         link --out /tmp/fused_moe_90.so && python3 bench/flashinfer_aot.py install --so /tmp/fused_moe_90.so
     fi 2>&1 | tee -a "$out/fi_install.log"
     timeout 300 python3 bench/bench_kernels.py --correctness --out "$out/corr" --shapes \
       "Mixtral-8x7B/TP8,Qwen3-30B-A3B/TP8,Mixtral-8x7B/TP2,Qwen3-30B-A3B/TP1" 2>&1 | tail -5 ;;
  2) source bench/device_env.sh || exit 1
     fi_env
     tune mixtral-8x7b 2 bf16 1.6; tune mixtral-8x7b 2 fp8 1.6
     tune qwen3-30b-a3b 1 bf16 1.6; tune qwen3-30b-a3b 1 fp8 1.6
     MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned timeout 240 python3 bench/fp8_backends.py \
       --out "$out/fp8b" 2>&1 | grep "^\[fp8b" | tail -30 ;;
  3) source bench/device_env.sh >/dev/null || exit 1
     fi_env
     dab stock,moe-serve fp8-static 520 fp8 && dab stock,moe-serve none $((540 - SECONDS)) bf16 ;;
esac
ls -la "$out"
