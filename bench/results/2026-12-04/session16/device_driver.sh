#!/usr/bin/env bash
# Session 16 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s16; /root/s16/DONE when finished
W=/root/s16; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s16_repo && mkdir /root/s16_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s16_repo
cd /root/s16_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
# bf16 Qwen3-30B-A3B over HTTP: vllm serve, moe-serve (--fused-router, the default, spelled out so it
# pools with session 9's rows) and moe-serve --moe-kernels vllm (the frontend alone), every round
echo "== serve left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b \
  --variants vllm-serve,moe-serve-fused-router,moe-serve-vllm-kernels --processes 3 --frontend-every 1 \
  --budget-s $(( $(left) - 15 )) --expect-process-s 190 --commit $COMMIT \
  --out $W/serve_ab/qwen3-30b-a3b > $W/serve.log 2>&1
echo "serve rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
echo "done $(date -u) left $(left) s"
