#!/usr/bin/env bash
# One H200 session for the kernel issues, split over the three calls that carry the vLLM
# bundle (shared/device): stage 1 and 2 tune (no vLLM needed), stage 3 benchmarks against
# vLLM. Tables persist in /root/tuned while the machine stays warm between calls.
#   bash bench/h200_kernels_session.sh STAGE OUT
set -uo pipefail
stage=$1 out=$2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /root/tuned "$out"
tune() {  # model tp dtype budget_min
  local q=""; [[ $3 == fp8 ]] && q="--quantization fp8"
  local t0=$SECONDS
  python3 -m kernels.tuning.tune_cli --model "bench/models/$1" -tp "$2" $q --budget-minutes "$4" \
    --no-vllm --out /root/tuned 2>&1 | grep -v "^\[tune\] \[" | tee -a "$out/tune.log"
  echo "TUNE_TIME $1 tp$2 $3 $((SECONDS - t0))s" | tee -a "$out/tune.log"
}
case $stage in
  1) tune mixtral-8x7b 8 bf16 1.6; tune qwen3-30b-a3b 8 bf16 1.6; tune deepseek-v3 8 bf16 1.6 ;;
  2) tune mixtral-8x7b 8 fp8 1.6; tune qwen3-30b-a3b 8 fp8 1.6; tune deepseek-v3 8 fp8 1.6 ;;
  3) MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned timeout 560 python3 bench/bench_kernels.py --bench \
       --shapes "$SHAPES" --ms 1,2,4,8,16,32,64,256,4096 --replays 10 \
       --out "$out/bench" 2>&1 | tee "$out/bench.log" | grep -v "^\[bench\]\|precompile" ;;
  4) # validation with the shipped tables and routing: fine M grid on the tuned shards,
     # the coarse grid on the others
     timeout 330 python3 bench/bench_kernels.py --bench --shapes "$TUNED_SHAPES" --replays 10 \
       --ms 1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256,384,512,768,1024,2048,4096 \
       --out "$out/tuned" 2>&1 | tee "$out/tuned.log" | grep -E "geomean|served <"
     timeout 230 python3 bench/bench_kernels.py --bench --shapes "$OTHER_SHAPES" --replays 10 \
       --ms 1,2,4,8,16,32,64,256,4096 --out "$out/untuned" 2>&1 | tee "$out/untuned.log" \
       | grep -E "geomean|served <" ;;
esac
cp /root/tuned/*.json "$out/" 2>/dev/null; ls -la "$out"
