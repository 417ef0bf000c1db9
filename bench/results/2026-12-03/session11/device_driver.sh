#!/usr/bin/env bash
# Session 11 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s11; /root/s11/DONE when finished
W=/root/s11; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s11_repo && mkdir /root/s11_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s11_repo
cd /root/s11_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
echo "== bench_moe_block $(date -u +%T)"
timeout 200 python bench/bench_moe_block.py --out $W/moe_block.json > $W/moe_block.log 2>&1; echo "moe_block rc $?"
echo "== explain $(date -u +%T)"
for m in qwen3-30b-a3b mixtral-8x7b qwen3-30b-a3b-fp8-block; do
  timeout 90 python -m service explain --model bench/models/$m > $W/explain_$m.txt 2>&1; echo "explain $m rc $?"
done
echo "== qwen3 left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b --variants vllm-serve,moe-serve --processes 1 --profile \
  --budget-s $(left) --expect-process-s 240 --commit $COMMIT --out $W/serve_qwen3 > $W/serve_qwen3.log 2>&1
echo "qwen3 rc $? left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model mixtral-8x7b --variants vllm-serve,moe-serve --processes 1 --profile \
  --budget-s $(left) --expect-process-s 270 --commit $COMMIT --out $W/serve_mixtral > $W/serve_mixtral.log 2>&1
echo "mixtral rc $? left $(left) s $(date -u +%T)"
if [ "$(left)" -gt 200 ]; then
  echo "== tune fp8-block $(date -u +%T)"
  B=$(python3 -c "print(max(0.5, min(2.0, ($(left) - 100) / 60)))")
  timeout $(( $(left) - 20 )) python -m service tune --model bench/models/qwen3-30b-a3b-fp8-block --budget-minutes $B \
    --out $W/tuned_fp8_block > $W/tune_fp8_block.log 2>&1; echo "tune rc $? left $(left) s"
fi
touch $W/DONE
