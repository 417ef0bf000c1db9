#!/usr/bin/env bash
# Build, on a CPU machine, the two FlashInfer artifacts bench/h200_session.sh carries to the H200
# host (Python 3.12, torch cu130, nvcc 13.0):
#   OUTDIR/fi-site.tar.xz      flashinfer-python, cuda-tile, nvidia-cudnn-frontend installed for
#                              cp312 manylinux x86_64 (`tar -C /opt/fi-site -xJf` gives /opt/fi-site/flashinfer)
#   OUTDIR/fused_moe_90.so.xz  FlashInfer's CUTLASS fused-MoE module for sm_90a, FP8 W8A8 units only,
#                              built by bench/flashinfer_aot.py (`objects`, then `link`)
#
#   bash bench/build_flashinfer.sh [OUTDIR]        # OUTDIR defaults to .dev/fi in the repo
#
# Needs: python3.11 (PYTHON), gcc/g++ (apt-get install g++), xz, unzip, nm/readelf (binutils), and
# PyPI through pip. Everything else goes under WORK (default /tmp/fi-build): the wheels, a Python 3.11
# build venv (CPU torch, which FlashInfer's jit package imports; apache-tvm-ffi; ninja), NVIDIA's
# CUDA 13.0 pip wheels assembled into a CUDA_HOME, FlashInfer's generated sources and objects (ws/).
# JOBS (default 2) nvcc processes compile the 33 CUTLASS units: ~35 min on 2 cores, under 2 GiB of
# memory each. Re-running is cheap: wheels, venv and toolkit are kept while their pins match, ninja
# rebuilds nothing already built; link and pack always rerun (~1 min).
# Without /opt/wheels' CPU torch (pip's find-links here), PyPI's torch==2.13.0 is the CUDA build and
# pulls GBs of nvidia libraries; pass a CPU one instead, e.g.
#   TORCH_SPEC="torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
set -euo pipefail

FI_VERSION=0.6.14                   # flashinfer-python (py3-none-any: same wheel in venv and site)
CUDA_TILE_VERSION=1.7.0
CUDNN_FE_VERSION=1.32.0
TVM_FFI_VERSION=0.1.10              # build venv only: the host's vLLM bundle already has it
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # build venv only: FlashInfer imports torch (see above)
NVCC_VERSION=13.0.88                # these eight: cuda-toolkit==13.0.2's pins (torch 2.11 cu130's
                                    # CUDA; the host's nvcc is 13.0.88)
CRT_VERSION=13.0.88
NVVM_VERSION=13.0.88
CUDART_VERSION=13.0.96
CCCL_VERSION=13.0.85
NVRTC_VERSION=13.0.88
CUBLAS_VERSION=13.1.0.3             # headers only (cudaUtils.h includes cublasLt.h)
CURAND_VERSION=10.4.0.35            # headers only (curand_kernel.h in the MoE kernels)

for tool in "${PYTHON:-python3.11}" gcc g++ xz unzip nm readelf; do
  command -v "$tool" >/dev/null || { echo "build_flashinfer.sh: $tool not found" >&2; exit 1; }
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUTDIR=$(mkdir -p "${1:-$ROOT/.dev/fi}" && cd "${1:-$ROOT/.dev/fi}" && pwd)
WORK=${WORK:-/tmp/fi-build}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3.11}
WHEELS=$WORK/wheels VENV=$WORK/venv CUDA_SITE=$WORK/cuda-site
CUDA_HOME=$CUDA_SITE/nvidia/cu13
mkdir -p "$WORK" "$WHEELS/cp312" "$WHEELS/cuda" "$WHEELS/cuda-headers"
cd "$ROOT"

t0=$SECONDS
phase() { echo "=== [$(date +%T)] $1 (previous phase $((SECONDS - t0)) s)"; t0=$SECONDS; }
PIP_QUIET=(--quiet --disable-pip-version-check)

phase "download: FlashInfer site wheels (cp312), CUDA $NVCC_VERSION wheels, build venv"
"$PYTHON" -m pip download "${PIP_QUIET[@]}" --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEELS/cp312" "flashinfer-python==$FI_VERSION" \
  "cuda-tile==$CUDA_TILE_VERSION" "nvidia-cudnn-frontend==$CUDNN_FE_VERSION"
# The toolkit runs here, so this machine's own platform tags (the cublas and curand wheels are
# tagged manylinux_2_27 alone, which the three --platform tags above do not match).
"$PYTHON" -m pip download "${PIP_QUIET[@]}" --no-deps --only-binary=:all: -d "$WHEELS/cuda" \
  "nvidia-cuda-nvcc==$NVCC_VERSION" "nvidia-cuda-crt==$CRT_VERSION" "nvidia-nvvm==$NVVM_VERSION" \
  "nvidia-cuda-runtime==$CUDART_VERSION" "nvidia-cuda-cccl==$CCCL_VERSION" "nvidia-cuda-nvrtc==$NVRTC_VERSION"
"$PYTHON" -m pip download "${PIP_QUIET[@]}" --no-deps --only-binary=:all: -d "$WHEELS/cuda-headers" \
  "nvidia-cublas==$CUBLAS_VERSION" "nvidia-curand==$CURAND_VERSION"
SITE_WHEELS=("$WHEELS/cp312/flashinfer_python-$FI_VERSION-"*.whl "$WHEELS/cp312/cuda_tile-$CUDA_TILE_VERSION-"*.whl
             "$WHEELS/cp312/nvidia_cudnn_frontend-$CUDNN_FE_VERSION-"*.whl)
ls -la "${SITE_WHEELS[@]}"

# FlashInfer's jit package imports torch (ABI flag), tvm_ffi (include paths), packaging, pynvml,
# tqdm, requests; the rest of its requirements (cutlass-dsl, cudnn, ...) are not needed to build.
venv_spec="$TORCH_SPEC apache-tvm-ffi==$TVM_FFI_VERSION flashinfer-python==$FI_VERSION ninja packaging nvidia-ml-py tqdm requests numpy"
if [[ ! -x $VENV/bin/python || $(cat "$VENV/.spec" 2>/dev/null) != "$venv_spec" ]]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC2086  # the spec's words are requirements
  "$VENV/bin/pip" install "${PIP_QUIET[@]}" --only-binary=:all: $TORCH_SPEC "apache-tvm-ffi==$TVM_FFI_VERSION" \
    ninja packaging nvidia-ml-py tqdm requests numpy
  "$VENV/bin/pip" install "${PIP_QUIET[@]}" --no-deps "$WHEELS/cp312/flashinfer_python-$FI_VERSION-py3-none-any.whl"
  echo "$venv_spec" > "$VENV/.spec"
fi

phase "toolkit: CUDA_HOME=$CUDA_HOME from NVIDIA's pip wheels"
toolkit_spec="nvcc $NVCC_VERSION crt $CRT_VERSION nvvm $NVVM_VERSION cudart $CUDART_VERSION cccl $CCCL_VERSION nvrtc $NVRTC_VERSION cublas $CUBLAS_VERSION curand $CURAND_VERSION"
if [[ $(cat "$CUDA_HOME/.spec" 2>/dev/null) != "$toolkit_spec" ]]; then
  rm -rf "$CUDA_SITE"     # pip --target does not merge into an existing nvidia/ directory
  "$PYTHON" -m pip install "${PIP_QUIET[@]}" --no-index --no-deps --no-compile --target "$CUDA_SITE" "$WHEELS/cuda/"*.whl
  for w in "$WHEELS/cuda-headers/"*.whl; do unzip -qo "$w" 'nvidia/cu13/include/*' -d "$CUDA_SITE"; done  # not the 500 MB of libs
  # The layout a toolkit has and the wheels lack: lib64, targets/x86_64-linux (nvcc.profile's
  # include and library dirs), unversioned .so names for -lcudart -lnvrtc, and lib64/stubs/libcuda.so
  # for -lcuda (the driver comes with no wheel): every cu* name in cuda.h as an empty function,
  # soname libcuda.so.1 as in NVIDIA's stub, so the module records the driver the host loads.
  ln -sfn lib "$CUDA_HOME/lib64"
  mkdir -p "$CUDA_HOME/targets/x86_64-linux" "$CUDA_HOME/lib/stubs"
  ln -sfn ../../include "$CUDA_HOME/targets/x86_64-linux/include"
  ln -sfn ../../lib "$CUDA_HOME/targets/x86_64-linux/lib"
  ln -sfn libcudart.so.13 "$CUDA_HOME/lib/libcudart.so"
  ln -sfn libnvrtc.so.13 "$CUDA_HOME/lib/libnvrtc.so"
  grep -oE '\bcu[A-Z][A-Za-z0-9_]*' "$CUDA_HOME/include/cuda.h" | sort -u \
    | sed 's/.*/void &(void) {}/' > "$CUDA_HOME/lib/stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_HOME/lib/stubs/libcuda.so" "$CUDA_HOME/lib/stubs/libcuda_stub.c"
  echo "$toolkit_spec" > "$CUDA_HOME/.spec"
fi
"$CUDA_HOME/bin/nvcc" --version | tail -2

export CUDA_HOME FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=$WORK/ws
export PATH=$VENV/bin:$CUDA_HOME/bin:$PATH
unset PYTHONPATH

phase "objects: bench/flashinfer_aot.py objects --jobs $JOBS"
"$VENV/bin/python" bench/flashinfer_aot.py objects --jobs "$JOBS"

phase "link: bench/flashinfer_aot.py link"
"$VENV/bin/python" bench/flashinfer_aot.py link --out "$WORK/fused_moe_90.so"
readelf -d "$WORK/fused_moe_90.so" | grep NEEDED
xz -T0 -6 -c "$WORK/fused_moe_90.so" > "$OUTDIR/fused_moe_90.so.xz.tmp"
mv "$OUTDIR/fused_moe_90.so.xz.tmp" "$OUTDIR/fused_moe_90.so.xz"

phase "pack: fi-site.tar.xz (cp312 manylinux x86_64)"
rm -rf "$WORK/fi-site"
"$PYTHON" -m pip install "${PIP_QUIET[@]}" --no-index --no-deps --no-compile --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --target "$WORK/fi-site" "${SITE_WHEELS[@]}"
tar -C "$WORK/fi-site" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@946684800 -cf - . \
  | xz -T0 -6 > "$OUTDIR/fi-site.tar.xz.tmp"
mv "$OUTDIR/fi-site.tar.xz.tmp" "$OUTDIR/fi-site.tar.xz"

phase "done (total $SECONDS s)"
ls -la "$OUTDIR/fi-site.tar.xz" "$OUTDIR/fused_moe_90.so.xz"
