#!/usr/bin/env bash
# One batch of GPU work in one call on a lent GPU machine: checks, then benchmarks, their logs and reports under $OUT.
#
#   OUT=/tmp/out bash bench/h200_run.sh tests:1 msda:0 matching:0 # step:GPU; steps on different GPUs run at once
#
# Steps (bench/README.md says what each benchmark answers): tests (the whole pytest suite on that GPU), msda
# (bench/msda.py, its launch table written into this copy's msda/launch_table.py for the later steps), matching, ttr,
# parity, export-latency, throughput (bench/<name>.py), ddp (bench/ddp.py), nccl-tests (rank parity on 2 GPUs).
# throughput, ddp and nccl-tests see every GPU: give them a call, or a place in the queue, of their own. Extra
# arguments for a step come from the environment: MSDA_ARGS, MATCHING_ARGS, TTR_ARGS, PARITY_ARGS, EXPORT_ARGS,
# THROUGHPUT_ARGS, DDP_ARGS, TEST_ARGS.
# Python packages the machine lacks (hydra-core, omegaconf, antlr4, pycocotools, faster-coco-eval) are installed
# from .whl/ when that folder holds their wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
if compgen -G ".whl/*.whl" >/dev/null; then
  # Installed once per machine: calls of this script that run at the same time share /tmp/site.
  [ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# A CXX without a shared libstdc++ (the H200 machine's /opt/gcc/bin/g++) builds AOTInductor packages that crash
# when loaded, and export.py refuses it (engine/export/aoti.py asks the compiler): the g++ on PATH has the library.
if [ -n "${CXX:-}" ]; then
  python3 -c "import sys; from engine.export.aoti import has_shared_libstdcxx
sys.exit(3 if has_shared_libstdcxx(sys.argv[1]) is False else 0)" "$CXX"
  if [ $? -eq 3 ]; then
    echo "CXX=$CXX has no shared libstdc++: using g++ ($(command -v g++))"
    export CXX=g++
  fi
fi
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv > "$OUT/gpus.csv" 2>&1

run_step() {  # name gpu
  local name=$1 gpu=$2
  case $name in
    # Two threads per test worker: the workers share the host's cores with whatever else this call runs.
    # -v names each test as it ends, so that a call cut short by its time limit still says which failed (-rfE lists
    # them only at the end). TEST_ARGS adds to it.
    tests) CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=2 python3 -m pytest -rfE -p no:cacheprovider \
             -n "${TEST_WORKERS:-4}" -v tests --durations=15 ${TEST_ARGS:-} ;;
    # The measured launch table goes into this copy's msda/launch_table.py, so that later steps run with it.
    msda) CUDA_VISIBLE_DEVICES=$gpu python3 bench/msda.py --out "$OUT" --apply-table ${MSDA_ARGS:-} ;;
    matching) CUDA_VISIBLE_DEVICES=$gpu python3 bench/matching.py --out "$OUT" ${MATCHING_ARGS:-} ;;
    ttr) CUDA_VISIBLE_DEVICES=$gpu python3 bench/ttr.py --out "$OUT" --work /tmp/bench_ttr ${TTR_ARGS:-} ;;
    parity) CUDA_VISIBLE_DEVICES=$gpu python3 bench/parity.py --out "$OUT" --work /tmp/bench_parity ${PARITY_ARGS:-} ;;
    export-latency) CUDA_VISIBLE_DEVICES=$gpu python3 bench/export_latency.py --out "$OUT" ${EXPORT_ARGS:-} ;;
    # Each row's profiler trace (gzipped) comes back too: where the GPU waits, op by op.
    throughput) python3 bench/throughput.py --out "$OUT" --traces "$OUT/traces" ${THROUGHPUT_ARGS:-} ;;
    ddp) python3 bench/ddp.py --out "$OUT" --traces "$OUT/traces" ${DDP_ARGS:-} ;;
    nccl-tests) python3 -m pytest -q -p no:cacheprovider tests/test_rank_parity.py tests/test_distributed.py ;;
    *) echo "unknown step $name"; return 2 ;;
  esac
}

pids=()
declare -A busy  # gpu -> the steps queued on it, run one after another
for arg in "$@"; do
  busy[${arg#*:}]+="${arg%%:*} "
done
for gpu in "${!busy[@]}"; do
  (
    for name in ${busy[$gpu]}; do
      echo "== $name on GPU $gpu: $(date -u +%T)"
      run_step "$name" "$gpu" > "$OUT/$name.log" 2>&1
      echo "== $name on GPU $gpu: exit $? at $(date -u +%T)"
      tail -n 25 "$OUT/$name.log"
    done
  ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
