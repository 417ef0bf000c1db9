#!/usr/bin/env bash
# Session 15 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s15; /root/s15/DONE when finished
W=/root/s15; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s15_repo && mkdir /root/s15_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s15_repo
cd /root/s15_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
# 1. the FP8 aligned path forced at M = 8..256, with the BLOCK_M = 32 candidates (checked vs vLLM first)
echo "== fp8-aligned $(date -u +%T)"
timeout 240 python bench/bench_kernels.py --fp8-aligned --out $W/aligned > $W/aligned.log 2>&1
echo "fp8-aligned rc $? left $(left) s"
# 2. tune the TP=8 block-FP8 shards (the tuner's GEMV family included), one output dir
for m in deepseek-v3-fp8-block qwen3-235b-a22b-fp8-block; do
  [ "$(left)" -gt 600 ] || continue
  echo "== tune $m left $(left) s $(date -u +%T)"
  timeout 330 python -m service tune --model bench/models/$m -tp 8 --budget-minutes 3.5 \
    --out $W/tune > $W/tune_$m.log 2>&1; echo "tune $m rc $? left $(left) s"
done
# 3. the block-FP8 format bench: ours as served (new tables) vs vLLM's block kernel vs the floor
if [ "$(left)" -gt 300 ]; then
  echo "== format-bench left $(left) s $(date -u +%T)"
  MOE_SERVE_KERNEL_CONFIG_DIR=$W/tune timeout $(( $(left) > 700 ? 420 : $(left) - 120 )) \
    python bench/bench_kernels.py --format-bench --out $W/fmt > $W/fmt.log 2>&1
  echo "format-bench rc $? left $(left) s"
fi
# 4. more block-FP8 Qwen3-30B-A3B processes over HTTP (vllm-serve first this time)
if [ "$(left)" -gt 300 ]; then
  echo "== serve left $(left) s $(date -u +%T)"
  python bench/serve_ab.py --model qwen3-30b-a3b-fp8-block --variants vllm-serve,moe-serve \
    --processes 2 --budget-s $(( $(left) - 20 )) --expect-process-s 150 --commit $COMMIT \
    --out $W/serve_ab/qwen3-30b-a3b-fp8-block > $W/serve.log 2>&1
  echo "serve rc $? left $(left) s $(date -u +%T)"
fi
touch $W/DONE
echo "done $(date -u) left $(left) s"
