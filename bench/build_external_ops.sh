#!/usr/bin/env bash
# Builds the two external attention ops that `bench/msda.py --external external/build` times beside ours:
#
#   deformable_detr  the original Deformable DETR CUDA op (MultiScaleDeformableAttention), fp32/fp64
#   dcnv4            DCNv4's FlashDeformAttn (the DCNv4 extension, flash_deform_attn_*), fp16/bf16/fp32
#
#   bash bench/build_external_ops.sh [LOG_DIR]    # on the GPU machine; LOG_DIR defaults to external/logs
#
# Their sources are not ours and are never committed: external/ is ignored. external/src/<op>/ holds the upstream
# files as they were taken, with their LICENSE and SOURCE (the repository and commit), from clones of each:
#   git -C Deformable-DETR archive HEAD models/ops/src models/ops/functions LICENSE \
#     | tar -x -C external/src/deformable_detr
#   git -C DCNv4 archive HEAD DCNv4_op/src DCNv4_op/DCNv4/functions/flash_deform_attn_func.py LICENSE \
#     | tar -x -C external/src/dcnv4
#   echo "github.com/<owner>/<name> $(git -C <clone> rev-parse HEAD)" > external/src/<op>/SOURCE
# This script copies each into external/obj/<op>/src, fixes the copy for today's toolkits (below, each fix
# with its reason), compiles it with torch.utils.cpp_extension (ninja; MAX_JOBS compilers at once) in its own
# build directory external/obj/<op>/, and puts what the benchmark imports into external/build/<op>/: the extension
# module, upstream's Python wrapper and BUILD_INFO (torch and CUDA versions, arch, source commit). external/build/
# is all that a later call needs to carry (about 16 MiB, 15 of them DCNv4's sm_90 kernels; 6 MiB as a tar.gz);
# external/obj/ holds the objects and may be deleted.
#
# Environment: MAX_JOBS (default: all cores), TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200), PYTHON (python3),
# EXTERNAL (the external/ folder, default: this checkout's), CUDA_HOME (default: /usr/local/cuda, else nvcc's).
# The two builds run at once and independently: one failing leaves the other's result, and each failure is named in
# the summary and its log (exit status 1 if any failed). A failed build leaves nothing in external/build/<op>/.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EXTERNAL=${EXTERNAL:-$ROOT/external}
LOGS=${1:-$EXTERNAL/logs}
PYTHON=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ]; then
  # torch guesses CUDA_HOME from `which nvcc`; a wrapper script such as /usr/local/bin/nvcc would make it /usr/local.
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
# cpp_extension links with $CXX. One without a shared libstdc++ (the H200 machine's /opt/gcc/bin/g++, which CXX names
# there) links a static copy, and torch crashes loading such a module; the g++ on PATH has the library (as in
# bench/h200_run.sh).
if [ -n "${CXX:-}" ] && ! "$CXX" -print-file-name=libstdc++.so 2>/dev/null | grep -q /; then
  echo "CXX=$CXX has no shared libstdc++: using g++ ($(command -v g++))"
  export CXX=g++
fi
mkdir -p "$LOGS" "$EXTERNAL/build" "$EXTERNAL/obj"

# Upstream sources of each op, relative to external/src/<op>/.
DETR_OPS=models/ops
DCN_OPS=DCNv4_op

# The fixes, seen on torch 2.14.1 with CUDA 13.0 (the GPU machine has torch 2.11): the first is needed, the others
# are the same calls without their deprecated spelling (warnings today), which keeps the build from breaking when
# torch drops them. Each is a plain substitution with the same meaning.
patch_deformable_detr() {  # $1: the staged copy of external/src/deformable_detr
  local src=$1/$DETR_OPS/src
  # Needed: AT_DISPATCH_FLOATING_TYPES takes a ScalarType; given the deprecated Tensor::type(), nvcc stops with
  # 'no suitable conversion function from "const at::DeprecatedTypeProperties" to "c10::ScalarType"'.
  sed -i -e 's/AT_DISPATCH_FLOATING_TYPES(value\.type()/AT_DISPATCH_FLOATING_TYPES(value.scalar_type()/g' \
    "$src/cuda/ms_deform_attn_cuda.cu"
  # Deprecated: x.type().is_cuda() is x.is_cuda(); Tensor::data<T>() is data_ptr<T>().
  sed -i -e 's/\.type()\.is_cuda()/.is_cuda()/g' "$src/ms_deform_attn.h" "$src/cuda/ms_deform_attn_cuda.cu"
  sed -i -e 's/\.data<\([a-z0-9_]*\)>()/.data_ptr<\1>()/g' "$src/cuda/ms_deform_attn_cuda.cu"
  # Deprecated: THC is gone from torch but for THC/THCAtomics.cuh, a header marked for removal that only includes
  # ATen/cuda/Atomic.cuh (the same atomicAdd overloads): include that directly.
  sed -i -e 's|#include <THC/THCAtomics.cuh>|#include <ATen/cuda/Atomic.cuh>|' "$src/cuda/ms_deform_im2col_cuda.cuh"
}

patch_dcnv4() {  # $1: the staged copy of external/src/dcnv4
  local src=$1/$DCN_OPS/src
  # Deprecated, as for the original op: THC's forwarding header, x.type().is_cuda(), data<T>(). (CUDA 13 also
  # warns that ulonglong4 is deprecated for ulonglong4_16a/_32a, which name its alignment: left as it is.)
  sed -i -e 's|#include <THC/THCAtomics.cuh>|#include <ATen/cuda/Atomic.cuh>|' "$src"/cuda/*.cuh "$src"/cuda/*.h
  sed -i -e 's/\.type()\.is_cuda()/.is_cuda()/g' -e 's/\.data<\([a-z0-9_]*\)>()/.data_ptr<\1>()/g' "$src"/cuda/*.cu
}

compile() {  # name build_dir include_dir sources...: torch.utils.cpp_extension.load into build_dir/name.so
  "$PYTHON" - "$@" <<'EOF'
import glob
import os
import sys

from torch.utils.cpp_extension import CUDA_HOME, load

name, build_dir, include_dir, *sources = sys.argv[1:]
# The flags of upstream's setup.py (WITH_CUDA selects the CUDA path of the dispatching headers) and -O3.
flags = ["-O3", "-DWITH_CUDA"]
if not os.path.exists(f"{CUDA_HOME}/include/cusparse.h"):
    # torch's ATen/cuda/CUDAContext.h includes the math libraries' headers (cusparse.h, cublas_v2.h), which a
    # toolkit of the compiler alone lacks; torch's CUDA wheels bring them (site-packages/nvidia/cu13/include).
    # Searched after the toolkit's own headers (-isystem, appended last).
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    for folder in sorted(glob.glob(f"{site}/nvidia/*/include")):
        if os.path.exists(f"{folder}/cusparse.h"):
            flags += ["-isystem", folder]
nvcc = [*flags, "-DCUDA_HAS_FP16=1", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__"]
load(name=name, sources=sources, build_directory=build_dir, extra_include_paths=[include_dir],
     extra_cflags=flags, extra_cuda_cflags=nvcc, with_cuda=True, verbose=True)
print(f"built {build_dir}/{name}.so")
EOF
}

build_info() {  # source_dir: "key: value" lines, read back by bench/external_ops.py
  "$PYTHON" -c "import torch; print(f'torch: {torch.__version__} (CUDA {torch.version.cuda})')"
  echo "arch: $TORCH_CUDA_ARCH_LIST"
  echo "nvcc: $(nvcc --version | tail -n 1)"
  echo "source: $(cat "$1/SOURCE")"
  date -u +"built: %Y-%m-%dT%H:%M:%SZ"
}

build() {  # op: stage, patch, compile, install into external/build/<op>/
  local op=$1 src=$EXTERNAL/src/$1 obj=$EXTERNAL/obj/$1 out=$EXTERNAL/build/$1
  rm -rf "$out" "$obj/src"
  if [ ! -f "$src/SOURCE" ]; then
    echo "no sources in $src (see bench/README.md: external ops)"
    return 1
  fi
  mkdir -p "$obj"
  # Only this script builds here. A build that was killed can leave cpp_extension's lock file behind, and torch
  # versions whose lock is that file's existence (2.14 takes an OS lock instead) would then wait on it forever.
  rm -f "$obj/lock"
  cp -r "$src" "$obj/src"
  local stage=$obj/src
  case $op in
    deformable_detr)
      patch_deformable_detr "$stage"
      compile MultiScaleDeformableAttention "$obj" "$stage/$DETR_OPS/src" \
        "$stage/$DETR_OPS/src/vision.cpp" "$stage/$DETR_OPS/src/cpu/ms_deform_attn_cpu.cpp" \
        "$stage/$DETR_OPS/src/cuda/ms_deform_attn_cuda.cu" || return 1
      mkdir -p "$out.tmp"
      cp "$obj/MultiScaleDeformableAttention.so" "$stage/$DETR_OPS/functions/ms_deform_attn_func.py" "$out.tmp/"
      ;;
    dcnv4)
      patch_dcnv4 "$stage"
      # The module is upstream's DCNv4.ext (its Python wrapper imports `from DCNv4 import ext`), so it is built as
      # `ext` and installed as DCNv4/ext.so, in an otherwise empty package (upstream's package imports all of DCNv4).
      compile ext "$obj" "$stage/$DCN_OPS/src" "$stage/$DCN_OPS/src/vision.cpp" \
        "$stage/$DCN_OPS/src/cuda/dcnv4_cuda.cu" "$stage/$DCN_OPS/src/cuda/flash_deform_attn_cuda.cu" || return 1
      mkdir -p "$out.tmp/DCNv4"
      cp "$obj/ext.so" "$out.tmp/DCNv4/"
      : >"$out.tmp/DCNv4/__init__.py"  # a regular package: found first on sys.path, before any installed DCNv4
      cp "$stage/$DCN_OPS/DCNv4/functions/flash_deform_attn_func.py" "$out.tmp/"
      ;;
  esac
  cp "$stage/LICENSE" "$out.tmp/"
  build_info "$stage" >"$out.tmp/BUILD_INFO"
  mv "$out.tmp" "$out"
  du -sh "$out"
}

echo "building into $EXTERNAL/build with CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
  "MAX_JOBS=$MAX_JOBS; logs in $LOGS"
declare -A pids
for op in deformable_detr dcnv4; do
  rm -rf "$EXTERNAL/build/$op.tmp"
  (build "$op") >"$LOGS/build_$op.log" 2>&1 &
  pids[$op]=$!
done
status=0
for op in deformable_detr dcnv4; do
  if wait "${pids[$op]}"; then
    echo "ok      $op -> $EXTERNAL/build/$op"
  else
    echo "FAILED  $op: see $LOGS/build_$op.log (its last lines:)"
    tail -n 15 "$LOGS/build_$op.log" | sed 's/^/    /'
    rm -rf "$EXTERNAL/build/$op.tmp"
    status=1
  fi
done
exit $status
