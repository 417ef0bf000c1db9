#!/usr/bin/env bash
# Session 11 device driver, second machine: one more alternating round of the yardstick (no profile).
#   drive2.sh END_EPOCH COMMIT     everything under /root/s11; /root/s11/DONE when finished
W=/root/s11; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s11_repo && mkdir /root/s11_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s11_repo
cd /root/s11_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
python bench/serve_ab.py --model mixtral-8x7b --variants moe-serve,vllm-serve --processes 1 \
  --budget-s $(left) --expect-process-s 165 --commit $COMMIT --out $W/serve_mixtral_r2 > $W/serve_mixtral_r2.log 2>&1
echo "mixtral r2 rc $? left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b --variants moe-serve,vllm-serve --processes 1 \
  --budget-s $(left) --expect-process-s 140 --commit $COMMIT --out $W/serve_qwen3_r2 > $W/serve_qwen3_r2.log 2>&1
echo "qwen3 r2 rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
