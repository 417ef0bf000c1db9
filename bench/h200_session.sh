#!/usr/bin/env bash
# One H200 session over the fewest calls that carry the vLLM bundle (shared/device) and the
# FlashInfer build (.dev/fi, bench/flashinfer_aot.py), back to back on one warm machine.
# Everything a later step needs is written under $OUT as it is produced: a call killed at its
# time limit returns only what is under $OUT.
#
#   bash bench/h200_session.sh pack              # here: cut the bundle into .dbundle/c0..c2 and
#       print each call's carry list
#   bash bench/h200_session.sh recv OUT          # host: each carried .dbundle/cN into /root/dbundle
#       (and a carried .dev/caches.tar.xz into /root)
#   bash bench/h200_session.sh tune OUT          # host, with the last chunk and .dev/fi: install
#       vLLM and FlashInfer, `moe-serve tune` Mixtral-8x7B TP=2 and Qwen3-30B-A3B TP=1 (bf16, fp8)
#   bash bench/h200_session.sh validate OUT      # host: the served kernel bench of those tables
#       (fine M list), the FP8 backend table on their shapes, then `ab`
#   bash bench/h200_session.sh ab OUT            # host: the decode A/B, FP8 static (stock vs
#       vllm-triton vs moe-serve) then bf16 (stock vs moe-serve), distinct sequences (decode_probe.py's
#       default), resumed from the runs committed under bench/results/*/*/decode_ab_<fp8|bf16>_spread
#   ORDER=vllm,optimized bash bench/h200_session.sh ttft OUT   # host: one cold-cache
#       `spike-sizes` TTFT A/B (bench/e2e_ab.py), both variants in ORDER; alternate it per call
#   AB_MODEL=qwen3-30b-a3b-tp8-rank (or a whole model with AB_GPU_UTIL=0.8) before `ab`: its A/B,
#       in decode_ab_<model>_<fp8|bf16>_spread
#   AB_ONLY=fp8 or AB_ONLY=bf16 before `ab`: that A/B alone
#   GRID=1 before `ab` or `ttft`: first the FP8 N=7168 grid (bench/investigations/fp8_large_n.py)
#   L2COLD=1 before `ab` or `ttft`: first the FP8 backends on the A/B's shard, warm and L2-flushed
#       (bench/fp8_backends.py --flush-l2), into OUT/fp8b_l2cold.json
#   bash bench/h200_session.sh retune OUT        # host: `moe-serve tune --force` of the fp8 tables
#       of every TUNED shape (A_PREQUANT among the candidates) into /root/tuned, GPU correctness
#       (every path, with A_PREQUANT), the served validation of the new tables, then the FP8 A/B
#       with moe-serve reading them (MOE_SERVE_KERNEL_CONFIG_DIR); a later `ab` call resumes it
# `ab` and `ttft` install first when they carry the last chunk (then no `tune` call is needed).
# Installing unpacks .dev/caches.tar.xz (an earlier call's OUT/caches.tar.xz.N joined with cat:
# vLLM's compile and FlashInfer's autotune caches; carried in a `recv` call of its own) into /root.
# CACHES=1 before a stage writes those parts at its end; .dev is not committed, so they serve only a
# later machine of the same checkout. .dev/fi comes from bench/build_flashinfer.sh (CPU, no GPU).
#
# pack: the working tree plus one chunk must stay under a call's 64 MiB, so the chunk size is
# 64 MiB minus the tree (tracked and untracked-not-ignored files) minus 2 MiB; the last chunk
# also rides with .dev/fi.
set -uo pipefail
stage=$1 out=${2:-}
LIMIT=$((64 * 1024 * 1024))
PARTS=(part00 part01 part02)                  # the bundle's parts, as SHA256SUMS names them
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
NEW_SHAPES="Mixtral-8x7B/TP2,Qwen3-30B-A3B/TP1"
BUDGET=${BUDGET:-560}                    # seconds of a call the A/B may start runs in
FINE_MS=1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256,384,512,768,1024,2048,4096

fi_env() {  # FlashInfer after vLLM's site on the path; nvcc on PATH (vLLM's has_flashinfer);
  # the CUDA 13 libraries the prebuilt module links (cudart, nvrtc) findable by the loader
  local nv; nv=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null)
  export PYTHONPATH=$PYTHONPATH:/opt/fi-site PATH=$PATH:/usr/local/cuda/bin
  export LD_LIBRARY_PATH=${nv:+$nv:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
host_env() {  # vLLM (installed by `tune`), moe-serve, FlashInfer
  source bench/device_env.sh >/dev/null || return 1
  fi_env
}
tune() {  # model tp dtype budget_min [tune_cli flag...]
  local q=""; [[ $3 == fp8 ]] && q="--quantization fp8"
  local t0=$SECONDS
  python3 -m kernels.tuning.tune_cli --model "bench/models/$1" -tp "$2" $q --budget-minutes "$4" \
    --out /root/tuned "${@:5}" 2>&1 | grep -v "^\[tune\] \[" | tee -a "$out/tune.log"
  echo "TUNE_TIME $1 tp$2 $3 with-vllm $((SECONDS - t0))s" | tee -a "$out/tune.log"
  tar -C /root -cf "$out/tuned.tar" tuned            # table names carry '=' and ','
  touch "/root/tuned.done.$1.$2.$3"
}
retune_fp8() {  # fp8 tables of every TUNED shape; one finished in an earlier call is not repeated
  for m in "mixtral-8x7b 8" "qwen3-30b-a3b 8" "deepseek-v3 8" "mixtral-8x7b 2" "qwen3-30b-a3b 1"; do
    [[ -f /root/tuned.done.${m% *}.${m#* }.fp8 ]] || tune ${m% *} ${m#* } fp8 1.3 --force
  done
}
tune_all() {  # the four runs; one finished in an earlier call is not repeated
  for m in "mixtral-8x7b 2" "qwen3-30b-a3b 1"; do
    for d in bf16 fp8; do
      [[ -f /root/tuned.done.${m% *}.${m#* }.$d ]] || tune ${m% *} ${m#* } $d 1.3
    done
  done
}
served_validation() {  # bench_kernels.py flags: the served bench of /root/tuned's tables, fine M list
  mkdir -p "$out/kernels"
  MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned timeout 240 python3 bench/bench_kernels.py --bench \
    --ms "$FINE_MS" --replays 10 --out "$out/kernels/validation" "$@" 2>&1 \
    | tee "$out/kernels/validation.log" | grep -E "geomean|served <|total"
}
dab() {  # variants quantization budget_s name: runs done on this machine or committed are skipped
  # (AB_MODEL: the bench/models model, default the Mixtral TP=8 rank; AB_GPU_UTIL for a whole model).
  # One process per variant also profiles (decode_profile.py). The runs are tarred into $out
  # every 15 s, so a call killed at its limit loses only the run in flight.
  local model=${AB_MODEL:-mixtral-8x7b-tp8-rank} name=$4
  [[ $model == mixtral-8x7b-tp8-rank ]] || name=${model}_$4
  local d=/root/dab-$name src pid
  mkdir -p "$d"
  for src in bench/results/*/*/decode_ab_"$name"; do cp -n "$src"/run-*.json "$d"/ 2>/dev/null; done
  python3 bench/decode_ab.py --model "$model" --quantization "$2" --variants "$1" \
    --gpu-memory-utilization "${AB_GPU_UTIL:-0.35}" --processes 6 --budget-s "$3" \
    --expect-run-s 200 --probe-timeout-s 420 --profile --out "$d" > "$d.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do sleep 15; snapshot "$name"; done
  wait "$pid"; local rc=$?
  grep "decode_ab" "$d.log"; snapshot "$name"
  return "$rc"
}
snapshot() {  # name: /root/dab-<name> (its run files and logs) into $out/dab-<name>.tar, atomically
  tar -C /root -cf "$out/.dab-$1.tar" --exclude=models "dab-$1" && mv "$out/.dab-$1.tar" "$out/dab-$1.tar"
}
install_all() {  # vLLM from the carried chunks (with the earlier calls' in /root/dbundle), FlashInfer
  mkdir -p /root/dbundle /opt/fi-site
  cp .dbundle/c[0-9] .dbundle/SHA256SUMS .dbundle/install.sh /root/dbundle/ || return 1
  (cd /root/dbundle && cat c[0-9] | split -b 57671680 -d -a 2 - part && rm c[0-9]) || return 1
  rm -rf .dbundle                                # device_env.sh would copy it again
  local t0=$SECONDS; host_env || return 1; echo "INSTALL_TIME vllm $((SECONDS - t0))s"
  tar -C /opt/fi-site -xJf .dev/fi/fi-site.tar.xz
  if [[ -f /root/caches.tar.xz ]]; then tar -C /root -xJf /root/caches.tar.xz && echo "restored caches"; fi
  xz -dc .dev/fi/fused_moe_90.so.xz > /tmp/fused_moe_90.so
  python3 bench/flashinfer_aot.py install --so /tmp/fused_moe_90.so 2>&1 | tail -3
}
caches() {  # vLLM's compile and FlashInfer autotune caches, for a later session to carry back
  tar -C /root -cf - --ignore-failed-read .cache/vllm .cache/flashinfer 2>/dev/null | xz -T0 -3 \
    | split -b 15M -d -a 1 - "$out/caches.tar.xz."
  ls -la "$out"/caches.tar.xz.*
}

case $stage in
  pack)
    tree=$(git ls-files -coz --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)   # what a call sends
    chunk=$((LIMIT - tree - 2 * 1024 * 1024))
    rm -f .dbundle/c[0-9]
    (cd .dbundle && cat "${PARTS[@]}" | split -b "$chunk" -d -a 1 - c)
    fi_bytes=$(du -cb .dev/fi/fi-site.tar.xz .dev/fi/fused_moe_90.so.xz | tail -1 | cut -f1)
    last=$(ls .dbundle/c[0-9] | tail -1)
    echo "tree $tree B, chunk $chunk B: $(ls .dbundle/c[0-9] | tr '\n' ' ')"
    (( $(stat -c %s "$last") + fi_bytes + tree < LIMIT - 1024 * 1024 )) || { echo "$last + .dev/fi over 64 MiB"; exit 1; }
    for c in .dbundle/c[0-9]; do [[ $c == "$last" ]] || echo "recv carry: [\"$c\"]"; done
    if [[ -f .dev/caches.tar.xz ]]; then
      (( $(stat -c %s .dev/caches.tar.xz) + tree < LIMIT - 1024 * 1024 )) || { echo ".dev/caches.tar.xz over 64 MiB"; exit 1; }
      echo 'recv carry: [".dev/caches.tar.xz"]'
    fi
    echo "stage carry: [\"$last\", \".dbundle/SHA256SUMS\", \".dbundle/install.sh\", \".dev/fi/fi-site.tar.xz\", \".dev/fi/fused_moe_90.so.xz\"]"
    ;;
  recv)
    mkdir -p /root/dbundle
    if ls .dbundle/c[0-9] >/dev/null 2>&1; then cp .dbundle/c[0-9] /root/dbundle/; fi
    if [[ -f .dev/caches.tar.xz ]]; then cp .dev/caches.tar.xz /root/; fi
    ls -la /root/dbundle /root/caches.tar.xz 2>&1
    { nvidia-smi -L; nproc; df -h /root | tail -1; } 2>&1 ;;
  tune)
    mkdir -p "$out" /root/tuned
    install_all 2>&1 | tee "$out/install.log"; host_env || exit 1
    tune_all ;;
  validate|ab|ttft|retune)
    mkdir -p "$out" /root/tuned
    if ls .dbundle/c[0-9] >/dev/null 2>&1; then install_all 2>&1 | tee "$out/install.log"; fi
    host_env || exit 1
    if [[ $stage == validate ]]; then
      tune_all
      served_validation --shapes "$NEW_SHAPES"
      MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned timeout 120 python3 bench/fp8_backends.py \
        --shapes "$NEW_SHAPES" --out "$out/kernels/fp8b" 2>&1 | grep "^\[fp8b" | tail -3
      tar -C "$out" -cf "$out/kernels.tar" kernels && rm -rf "$out/kernels"
    fi
    if [[ $stage == retune ]]; then
      retune_fp8
      mkdir -p "$out/kernels"
      MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned timeout 150 python3 bench/bench_kernels.py --correctness \
        --dtypes fp8 --out "$out/kernels/correctness" 2>&1 | tee "$out/kernels/correctness.log" \
        | grep -E "PASS,|FAIL"
      served_validation --dtypes fp8
      tar -C "$out" -cf "$out/kernels.tar" kernels && rm -rf "$out/kernels"
    fi
    if [[ -n ${GRID:-} ]]; then
      timeout 200 python3 bench/investigations/fp8_large_n.py --out "$out/fp8_large_n" 2>&1 \
        | tee "$out/grid.log" | grep -E "^M="
    fi
    if [[ -n ${L2COLD:-} ]]; then
      timeout 200 python3 bench/fp8_backends.py --shapes Mixtral-8x7B/TP8 --ms 1,2,4,8,16,32,64,128 \
        --flush-l2 --out /root/fp8b_l2cold 2>&1 | tee "$out/fp8b_l2cold.log" | grep -E "^\[fp8b" | cut -c1-400
      cp /root/fp8b_l2cold/fp8_backends.json "$out/fp8b_l2cold.json"
    fi
    if [[ $stage == ttft ]]; then
      timeout $((BUDGET - SECONDS)) python3 bench/e2e_ab.py --scenarios spike-sizes \
        --variants "${ORDER:-vllm,optimized}" --out "$out/ttft" 2>&1 | grep -v "^INFO"
      tar -C "$out" -cf "$out/ttft.tar" ttft && rm -rf "$out/ttft"
    elif [[ -f /root/tuned.done.mixtral-8x7b.8.fp8 ]]; then   # retuned here: moe-serve reads them
      MOE_SERVE_KERNEL_CONFIG_DIR=/root/tuned dab stock,moe-serve fp8-static $((BUDGET - SECONDS)) fp8_retuned
    else
      if [[ ${AB_ONLY:-fp8} == fp8 ]]; then dab stock,vllm-triton,moe-serve fp8-static $((BUDGET - SECONDS)) fp8_spread; fi \
        && if [[ ${AB_ONLY:-bf16} == bf16 ]]; then dab stock,moe-serve none $((BUDGET - SECONDS)) bf16_spread; fi
    fi
    if [[ -n ${CACHES:-} ]] && (( SECONDS < BUDGET + 15 )); then caches; fi ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
if [[ -n $out ]]; then ls -la "$out"; fi
