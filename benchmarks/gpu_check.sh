#!/usr/bin/env bash
# Everything that needs a GPU, in one call: the environment, the CUDA tests, the GPU benchmarks.
#
#     STAGES=tests,qk,memory,fep OUT=/tmp/gpu benchmarks/gpu_check.sh
#
# Runs from the repository root with the machine's own python3 (its torch and triton; nothing is installed).
# WORKERS (pytest-xdist workers of the test stage), FEP_SIZES, FEP_TRAIN_SIZES, TILES_KS, TILES_LAUNCHES (kl_attention_tiles.py --launches), MEMORY_LENGTHS and MEMORY_UNROLLED ('' for none) narrow the benchmarks' sizes.
# Each stage has its own time limit (seconds, env TESTS_S, QK_S, MEMORY_S, FEP_S, PROFILE_S, TILES_S), so one slow
# stage cannot eat the others. Logs, the tests' JUnit XML and the benchmark JSON/PNG files end up in $OUT (a tarball
# of benchmarks/results/*-cuda* as gpu_results.tar.gz, remade after every stage: a call stopped at its limit keeps
# what the finished stages wrote).
set -u
OUT=${OUT:-gpu_out}
STAGES=${STAGES:-tests,qk,memory,fep}  # and profile (a kernel table of the FEP training step), tiles (KL launches)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export MPLBACKEND=Agg
log="$OUT/gpu_check.log"

stage() {  # stage NAME SECONDS COMMAND...: run unless NAME is not in $STAGES; record its time and status
    local name=$1 limit=$2
    shift 2
    [[ ",$STAGES," == *",$name,"* ]] || return 0
    local start=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    # SIGINT first: pytest and the benchmarks stop as after Ctrl-C, printing what they have
    timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$log" | tail -n 40
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - start))s" | tee -a "$log"
    tar czf "$OUT/gpu_results.tar.gz" benchmarks/results/*-cuda* 2>/dev/null || echo "no benchmark results written"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    python3 -c "import hecate, hecate.lowering; print('hecate imports')"
} 2>&1 | tee -a "$log"

# TESTS (env) narrows the test stage to some files or node ids, e.g. the ones a previous run did not reach
TESTS=${TESTS:-tests/test_cuda.py tests/test_cuda_spellings.py tests/lowering/memory_scan/test_memory_scan_kernels.py \
    tests/lowering/memory_scan/test_chunk_kernels.py tests/lowering/qk_preprocess/test_qk_preprocess_numerics.py \
    tests/lowering/qk_preprocess/test_qk_preprocess_triton.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
# WORKERS (default 8) share the machine's cores: each worker's float64 references on the CPU get
# cores / WORKERS threads, which would otherwise each take all of them
WORKERS=${WORKERS:-8}
stage tests "${TESTS_S:-240}" env OMP_NUM_THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 )) \
    python3 -m pytest -m cuda -v -n "$WORKERS" -p no:cacheprovider --timeout=150 --durations=30 -rfE --tb=short \
    --junitxml="$OUT/cuda_tests.xml" $TESTS
stage fep "${FEP_S:-120}" python3 benchmarks/fep.py --device cuda --sizes "${FEP_SIZES:-1024x16,1024x64,4096x64}" \
    --compiled-train-sizes "${FEP_TRAIN_SIZES:-1024x16}" --merge --no-progress

stage profile "${PROFILE_S:-90}" python3 benchmarks/profile_fep.py --device cuda --n 1024 --k 16 \
    --out "$OUT/profile_fep_hecate.txt"
stage tiles "${TILES_S:-90}" python3 benchmarks/kl_attention_tiles.py --n 1024 --ks "${TILES_KS:-16,64}" \
    --launches "${TILES_LAUNCHES:-}"
stage qk "${QK_S:-120}" python3 benchmarks/qk_preprocess.py --device cuda --no-progress
stage memory "${MEMORY_S:-150}" python3 benchmarks/memory_scan.py --device cuda --dims 64 --lengths "${MEMORY_LENGTHS:-256,1024,4096}" \
    --unrolled-lengths "${MEMORY_UNROLLED-16}"
