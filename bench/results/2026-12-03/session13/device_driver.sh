#!/usr/bin/env bash
# Session 13 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s13; /root/s13/DONE when finished
W=/root/s13; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s13_repo && mkdir /root/s13_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s13_repo
cd /root/s13_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
# 1. FP8-dynamic (compressed-tensors, per-channel weights, per-token activations): tune, then serve
echo "== tune fp8-dynamic $(date -u +%T)"
timeout 260 python -m service tune --model bench/models/qwen3-30b-a3b-fp8-dynamic --budget-minutes 3 \
  --out $W/tune_fp8dyn > $W/tune_fp8dyn.log 2>&1; echo "tune fp8dyn rc $? left $(left) s"
echo "== serve fp8-dynamic left $(left) s $(date -u +%T)"
MOE_SERVE_KERNEL_CONFIG_DIR=$W/tune_fp8dyn python bench/serve_ab.py --model qwen3-30b-a3b-fp8-dynamic \
  --variants moe-serve,vllm-serve --processes 1 --budget-s $(( $(left) - 300 )) --expect-process-s 200 \
  --commit $COMMIT --out $W/serve_ab/qwen3-30b-a3b-fp8-dynamic > $W/serve_fp8dyn.log 2>&1
echo "serve fp8dyn rc $? left $(left) s $(date -u +%T)"
# 2. bf16 Qwen3-30B-A3B: the block bench on the shipped table, the joint tuner, the block bench on its table
echo "== block shipped $(date -u +%T)"
timeout 120 python bench/bench_moe_block.py --shapes qwen3-30b-a3b --m 1,2,4,8 --out $W/block_shipped.json \
  > $W/block_shipped.log 2>&1; echo "block shipped rc $?"
echo "== tune bf16 left $(left) s $(date -u +%T)"
timeout 300 python -m service tune --model bench/models/qwen3-30b-a3b --budget-minutes 3.5 --out $W/tune_bf16 \
  > $W/tune_bf16.log 2>&1; echo "tune bf16 rc $? left $(left) s"
echo "== block tuned $(date -u +%T)"
MOE_SERVE_KERNEL_CONFIG_DIR=$W/tune_bf16 timeout 120 python bench/bench_moe_block.py --shapes qwen3-30b-a3b \
  --m 1,2,4,8 --out $W/block_tuned.json > $W/block_tuned.log 2>&1; echo "block tuned rc $?"
python3 - $W > $W/gate.txt 2>&1 <<'PY'
import json, math, sys
w = sys.argv[1]
sp = {k: {r["M"]: r["speedup_vs_vllm"] for r in json.load(open(f"{w}/block_{k}.json"))["rows"]}
      for k in ("shipped", "tuned")}
ms = sorted(set(sp["shipped"]) & set(sp["tuned"]))
rel = [sp["tuned"][m] / sp["shipped"][m] for m in ms]
g = math.exp(sum(map(math.log, rel)) / len(rel))
print("M", ms, "shipped", [sp["shipped"][m] for m in ms], "tuned", [sp["tuned"][m] for m in ms])
print(f"tuned/shipped geomean {g:.4f} min {min(rel):.4f}")
print("GATE_OK" if g >= 1.015 and min(rel) >= 0.98 else "GATE_NO")
PY
cat $W/gate.txt
if grep -q GATE_OK $W/gate.txt && [ "$(left)" -gt 420 ]; then
  echo "== serve qwen3 tuned left $(left) s $(date -u +%T)"
  MOE_SERVE_KERNEL_CONFIG_DIR=$W/tune_bf16 python bench/serve_ab.py --model qwen3-30b-a3b \
    --variants moe-serve,vllm-serve --processes 1 --budget-s $(( $(left) - 20 )) --expect-process-s 200 \
    --commit $COMMIT --out $W/serve_ab/qwen3-30b-a3b-tuned > $W/serve_qwen3.log 2>&1
  echo "serve qwen3 rc $? left $(left) s $(date -u +%T)"
fi
if [ "$(left)" -gt 120 ]; then
  echo "== fp8-aligned left $(left) s $(date -u +%T)"
  timeout $(( $(left) - 20 )) python bench/bench_kernels.py --fp8-aligned --out $W/kern > $W/fp8_aligned.log 2>&1
  echo "fp8-aligned rc $? left $(left) s"
fi
touch $W/DONE
