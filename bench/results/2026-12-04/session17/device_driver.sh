#!/usr/bin/env bash
# Session 17 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s17; /root/s17/DONE when finished
W=/root/s17; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s17_repo && mkdir /root/s17_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s17_repo
cd /root/s17_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
# 1. the up kernel's L2 prefetch of the down weights vs the served config, per shape / format / M
echo "== prefetch left $(left) s $(date -u +%T)"
timeout 330 python bench/bench_prefetch.py --out $W/prefetch > $W/prefetch.log 2>&1
echo "prefetch rc $? left $(left) s $(date -u +%T)"
# 2. the shipped tables refined with the prefetch phase only (routing kept), into one dir
R=$W/refine; mkdir -p $R
for m in "qwen3-30b-a3b 1" "qwen3-30b-a3b-fp8-block 1" "deepseek-v3-fp8-block 8" "qwen3-235b-a22b-fp8-block 8" "mixtral-8x7b 1"; do
  set -- $m
  echo "== refine $1 tp$2 left $(left) s $(date -u +%T)"
  timeout 150 python -m service tune --model bench/models/$1 -tp $2 --refine "decode prefetch" \
    --buckets 1,2,4,8 --budget-minutes 1.5 --out $R >> $W/refine.log 2>&1
  echo "refine $1 rc $? left $(left) s"
done
# 3. bf16 Qwen3-30B-A3B over HTTP with the engine built as vllm serve builds it (eeeffc5) and
#    the refined tables: vllm serve, moe-serve, moe-serve --moe-kernels vllm, every round
echo "== serve left $(left) s $(date -u +%T)"
MOE_SERVE_KERNEL_CONFIG_DIR=$R python bench/serve_ab.py --model qwen3-30b-a3b \
  --variants vllm-serve,moe-serve,moe-serve-vllm-kernels --processes 3 --frontend-every 1 \
  --budget-s $(( $(left) - 15 )) --expect-process-s 190 --commit $COMMIT \
  --out $W/serve_ab/qwen3-30b-a3b > $W/serve.log 2>&1
echo "serve rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
echo "done $(date -u) left $(left) s"
