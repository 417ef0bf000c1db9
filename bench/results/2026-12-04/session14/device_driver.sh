#!/usr/bin/env bash
# Session 14 device driver (lab plumbing, not in the product). Run detached (setsid) from the repo root:
#   drive.sh END_EPOCH COMMIT      everything under /root/s14; /root/s14/DONE when finished
W=/root/s14; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s14_repo && mkdir /root/s14_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s14_repo
cd /root/s14_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
# 1. the GEMV decode path vs the served path, vLLM and the floor (kernel level, checked first)
echo "== bench_gemv $(date -u +%T)"
timeout 270 python bench/bench_gemv.py --out $W/gemv --ms 1,2,4 \
  --cells "Qwen3-30B-A3B/TP1:bf16;Mixtral-8x7B/TP1:bf16;Qwen3-30B-A3B/TP1:fp8_w8a8,block_shape=[128,128];DeepSeek-V3/TP8:fp8_w8a8,block_shape=[128,128];Qwen3-235B-A22B/TP8:bf16" \
  > $W/gemv.log 2>&1; echo "bench_gemv rc $? left $(left) s"
python3 - $W > $W/gate.txt 2>&1 <<'PY'
import json, sys
w = sys.argv[1]
rows = json.load(open(f"{w}/gemv/gemv.json"))["rows"]
for name, tag in (("Qwen3-30B-A3B/TP1", "qwen3"), ("Mixtral-8x7B/TP1", "mixtral")):
    r = [x for x in rows if x["shape"] == name and x["format"] == "bf16" and x["M"] == 1 and "gemv_vs_served" in x]
    ok = bool(r) and r[0]["gemv_vs_served"] >= 1.03 and r[0].get("err_vs_f64", 1) < 2e-2
    print(tag, r[0]["gemv_vs_served"] if r else None, r[0].get("err_vs_f64") if r else None, "GATE_OK" if ok else "GATE_NO")
PY
cat $W/gate.txt
# 2. tune the models whose M = 1 the GEMV wins (the tuner's gemv family competes with the others)
for m in qwen3 mixtral; do
  model=$([ $m = qwen3 ] && echo qwen3-30b-a3b || echo mixtral-8x7b)
  if grep -q "^$m .*GATE_OK" $W/gate.txt && [ "$(left)" -gt 700 ]; then
    echo "== tune $model left $(left) s $(date -u +%T)"
    timeout 220 python -m service tune --model bench/models/$model --budget-minutes 2.7 --force \
      --out $W/tune_$m > $W/tune_$m.log 2>&1; echo "tune $m rc $? left $(left) s"
  fi
done
# 3. the yardstick with the new tables: Qwen3 first, then Mixtral, moe-serve first in each
for m in qwen3 mixtral; do
  model=$([ $m = qwen3 ] && echo qwen3-30b-a3b || echo mixtral-8x7b)
  ls $W/tune_$m/*bf16* >/dev/null 2>&1 || continue
  [ "$(left)" -gt 260 ] || continue
  n=$([ $m = qwen3 ] && echo 2 || echo 1)
  echo "== serve $model left $(left) s $(date -u +%T)"
  MOE_SERVE_KERNEL_CONFIG_DIR=$W/tune_$m python bench/serve_ab.py --model $model \
    --variants moe-serve,vllm-serve --processes $n --budget-s $(( $(left) - 20 )) --expect-process-s 210 \
    --commit $COMMIT --out $W/serve_ab/$model > $W/serve_$m.log 2>&1
  echo "serve $m rc $? left $(left) s $(date -u +%T)"
done
touch $W/DONE
echo "done $(date -u) left $(left) s"
