#!/usr/bin/env bash
# Session 9 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s9; /root/s9/DONE when finished
W=/root/s9; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s9_repo && mkdir /root/s9_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s9_repo
cd /root/s9_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
echo "== bench_router $(date -u +%T)"
timeout 300 python bench/bench_router.py --out $W/router.json > $W/router.log 2>&1; echo "router rc $?"
echo "== explain $(date -u +%T)"
for m in qwen3-30b-a3b mixtral-8x7b qwen3-30b-a3b-fp8-block; do
  timeout 90 moe-serve explain --model bench/models/$m > $W/explain_$m.txt 2>&1; echo "explain $m rc $?"
done
V=$(python3 - <<'PY'
import json, pathlib
p = pathlib.Path("/root/s9/router.json")
try:
    rows = json.loads(p.read_text())["rows"]
    r1 = [r for r in rows if r["shape"] == "qwen3-30b-a3b" and r["M"] == 1][0]
    print("moe-serve-fused-router" if r1["speedup"] >= 1.15 else "moe-serve")
except Exception:
    print("moe-serve")
PY
)
echo "== qwen3 variant $V, left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b --variants vllm-serve,$V --processes 2 \
  --budget-s $(left) --expect-process-s 230 --commit $COMMIT --out $W/serve_qwen3 > $W/serve_qwen3.log 2>&1
echo "qwen3 rc $? left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model mixtral-8x7b --variants vllm-serve,moe-serve --processes 2 \
  --budget-s $(left) --expect-process-s 260 --commit $COMMIT --out $W/serve_mixtral > $W/serve_mixtral.log 2>&1
echo "mixtral rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
