#!/usr/bin/env bash
# Session 12 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s12; /root/s12/DONE when finished
W=/root/s12; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s12_repo && mkdir /root/s12_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s12_repo
cd /root/s12_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
echo "== bench_attention $(date -u +%T)"
timeout 300 python bench/bench_attention.py --out $W/attention.json > $W/attention.log 2>&1; echo "attention rc $?"
echo "== qwen3 left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b --variants vllm-serve,moe-serve-triton-attn --processes 2 \
  --budget-s $(( $(left) - 500 )) --expect-process-s 160 --commit $COMMIT --out $W/serve_qwen3 > $W/serve_qwen3.log 2>&1
echo "qwen3 rc $? left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model mixtral-8x7b --variants vllm-serve,moe-serve-triton-attn --processes 2 \
  --budget-s $(left) --expect-process-s 250 --commit $COMMIT --out $W/serve_mixtral > $W/serve_mixtral.log 2>&1
echo "mixtral rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
