#!/usr/bin/env bash
# Session 12, second machine: device driver (lab plumbing, not in the product). Run detached (setsid):
#   drive.sh END_EPOCH COMMIT      everything under /root/s12b; /root/s12b/DONE when finished
W=/root/s12b; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s12b_repo && mkdir /root/s12b_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s12b_repo
cd /root/s12b_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
echo "== bench_dense $(date -u +%T)"
timeout 240 python bench/bench_dense.py --out $W/dense.json > $W/dense.log 2>&1; echo "dense rc $?"
echo "== bench_dense sweep $(date -u +%T)"
timeout 240 python bench/bench_dense.py --sweep --m 1 --out $W/dense_sweep.json \
  --shapes qwen3-30b-a3b.qkv,qwen3-30b-a3b.o,mixtral-8x7b.qkv,mixtral-8x7b.o > $W/dense_sweep.log 2>&1; echo "sweep rc $?"
GO=$(python3 - <<'PY'
import json, math
try:
    rows = json.load(open("/root/s12b/dense.json"))["rows"]
except Exception:
    print(0); raise SystemExit
r = [x["speedup"] for x in rows if x["M"] == 1 and x["shape"].split(".")[0] in ("qwen3-30b-a3b", "mixtral-8x7b")]
print(1 if r and math.exp(sum(map(math.log, r)) / len(r)) > 1.02 else 0)
PY
)
echo "go $GO"
if [ "$GO" = 1 ]; then
  echo "== qwen3 left $(left) s $(date -u +%T)"
  python bench/serve_ab.py --model qwen3-30b-a3b --variants vllm-serve,moe-serve-dense --processes 2 \
    --budget-s $(( $(left) - 560 )) --expect-process-s 160 --commit $COMMIT --out $W/serve_qwen3 > $W/serve_qwen3.log 2>&1
  echo "qwen3 rc $? left $(left) s $(date -u +%T)"
  python bench/serve_ab.py --model mixtral-8x7b --variants moe-serve-dense,vllm-serve --processes 2 \
    --budget-s $(left) --expect-process-s 250 --commit $COMMIT --out $W/serve_mixtral > $W/serve_mixtral.log 2>&1
  echo "mixtral rc $? left $(left) s $(date -u +%T)"
fi
touch $W/DONE
