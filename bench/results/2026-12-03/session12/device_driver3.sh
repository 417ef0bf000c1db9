#!/usr/bin/env bash
# Session 12, third machine: device driver (lab plumbing, not in the product). Run detached (setsid):
#   drive.sh END_EPOCH COMMIT      everything under /root/s12c; /root/s12c/DONE when finished
W=/root/s12c; mkdir -p $W
END=$1; COMMIT=$2
left() { echo $(( END - $(date +%s) )); }
rm -rf /root/s12c_repo && mkdir /root/s12c_repo && tar --exclude=./.dbundle -cf - . | tar -xf - -C /root/s12c_repo
cd /root/s12c_repo
exec > $W/drive.log 2>&1
echo "start $(date -u) left $(left) s commit $COMMIT"
nvidia-smi > $W/gpu.txt 2>&1
echo "== ncu $(date -u +%T)"
timeout 150 ncu --clock-control none -k regex:moe_decode --launch-skip 16 --launch-count 4 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats python .dev/s12c/ncu_probe.py > $W/ncu.txt 2>&1; echo "ncu rc $?"
echo "== block-fp8 qwen3 left $(left) s $(date -u +%T)"
python bench/serve_ab.py --model qwen3-30b-a3b-fp8-block --variants vllm-serve,moe-serve --processes 2 \
  --budget-s $(left) --expect-process-s 190 --commit $COMMIT --out $W/serve_qwen3_fp8_block > $W/serve_qwen3_fp8_block.log 2>&1
echo "fp8-block rc $? left $(left) s $(date -u +%T)"
touch $W/DONE
