#!/usr/bin/env bash
# One device-tool call: the stages named in STAGES (default "tests offload"), logs under $OUT.
#   STAGES="tests attn offload" bash bench/device_run.sh [pytest-paths...]   (carry .whl: bitsandbytes)
# tests:   the GPU tests (default: offload + gpu_ops)
# attn:    bench/cpu_attention.py for bf16 and int8, first as the engine runs it, then again with
#          Numba's default CPU features (256-bit vectors on AVX-512 Xeons): the A/B of 512-bit vectors
#          (ATTN_AB=0: the first only; ATTN_JIT=1: with the first-call JIT times; ATTN_ARGS passed through,
#          e.g. "--threads 8 --int8-sweep 64:2,128:4")
# gpudecode: bench/gpu_decode.py (all-GPU decode and prefill, per-linear NF4 kernels; GPUDECODE_ARGS="--only b1")
# mma:     bench/nf4_mma.py (the W4A16 tensor-core kernel's sweep at 4-64 rows vs bitsandbytes; MMA_ARGS passed through)
# trace:   bench/step_trace.py for each of TRACE (workload names, "_" for spaces; needs the offload stage's profile)
# probe:   bench/pcie_probe.py (host→device copy rates from a large pinned pool, beside the CPU kernels)
# profile: `hetero profile --refresh` with empty Numba, Triton and profile caches (a fresh machine's first
#          run: the kernels compile), then again with them filled; wall times printed
# parts:   bench/profile_parts.py (where the profile's time goes: imports, then measure() under cProfile)
# ports:   bench/cpu_ports.py (vector instruction throughput at 1..16 threads: ports, clock, hyperthreads)
# scaling: bench/cpu_scaling.py (fixed cost, in-cache and DRAM rates at 1, 8, 16 threads, with the default and 16
#          items a thread; SCALING_ARGS passed through), then 8 and 16 threads again with OpenMP's threads bound
#          (OMP_PROC_BIND=spread / close, OMP_PLACES=threads; SCALING_BINDS="" skips those)
# kparts:  bench/cpu_kernel_parts.py at KPARTS_THREADS (default "1 16") threads (where the int8 / int4 kernels'
#          time goes; KPARTS_DTYPES, default int8,int4)
# cputests: the CPU kernel tests on this host's CPU (its vector width and VNNI; CPUTESTS_K: a pytest -k filter)
# offload: bench/offload_decode.py (ONLY="8k bf16,32k int8" picks workloads; BENCH_ARGS passed through)
# kvattn:  bench/gpu_kv_attention.py (paged decode attention over bf16 / int8 / int4 device blocks, GB/s vs HBM)
# budget:  bench/budget.py (decode at each --gpu-mem budget, the planner's own choice; BUDGET_ARGS passed through)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests offload}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, numba, transformers; print('torch', torch.__version__, 'numba', numba.__version__, 'transformers', transformers.__version__)"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3|Flags" | cut -c1-300 > "$OUT/lscpu.txt"
for stage in $STAGES; do
  case $stage in
    tests)
      [ $# -gt 0 ] || set -- tests/test_offload_gpu.py tests/test_gpu_ops.py
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    profile)
      d=$(mktemp -d)
      for run in cold warm; do
        t0=$(date +%s.%N)
        XDG_CACHE_HOME=$d/xdg NUMBA_CACHE_DIR=$d/numba TRITON_CACHE_DIR=$d/triton timeout 300 \
          python3 -c "import cli; cli.main()" profile --refresh > "$OUT/profile_$run.log" 2>&1
        echo "hetero profile --refresh, $run caches: exit $?, $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s wall" \
          | tee -a "$OUT/profile_$run.log"
        grep -i "measured in\|varied\|failed" "$OUT/profile_$run.log" | cut -c1-220
      done ;;
    parts)
      timeout 200 python3 bench/profile_parts.py > "$OUT/profile_parts.log" 2>&1; grep -v "^ *[0-9]* *0\.0" "$OUT/profile_parts.log" \
        | head -${PARTS_TAIL:-70} | cut -c1-160 ;;
    ports)
      timeout 120 python3 bench/cpu_ports.py > "$OUT/cpu_ports.log" 2>&1; tail -${PORTS_TAIL:-24} "$OUT/cpu_ports.log" ;;
    scaling)
      lscpu -e > "$OUT/lscpu_e.txt" 2>&1; head -20 "$OUT/lscpu_e.txt"; export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-scaling}
      timeout ${SCALING_TIMEOUT:-300} python3 bench/cpu_scaling.py --more-items ${SCALING_ARGS:-} --out "$OUT/scaling" \
        > "$OUT/scaling_stdout.log" 2>&1; tail -12 "$OUT/scaling_stdout.log"
      for bind in ${SCALING_BINDS-spread close}; do
        OMP_PROC_BIND=$bind OMP_PLACES=threads timeout 150 python3 bench/cpu_scaling.py --threads 8,16 \
          --dtypes ${SCALING_BOUND_DTYPES:-int8,bf16} --out "$OUT/scaling_$bind" > "$OUT/scaling_$bind.log" 2>&1
        echo "OMP_PROC_BIND=$bind:"; tail -5 "$OUT/scaling_$bind.log"
      done ;;
    kparts)
      for th in ${KPARTS_THREADS:-1 16}; do
        timeout 150 python3 bench/cpu_kernel_parts.py --threads $th --reps 10 --dtypes ${KPARTS_DTYPES:-int8,int4} \
          > "$OUT/kernel_parts_$th.log" 2>&1
        cat "$OUT/kernel_parts_$th.log"
      done ;;
    cputests)
      timeout ${CPUTESTS_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_simd.py tests/test_cpu_attention.py \
        ${CPUTESTS_K:+-k "$CPUTESTS_K"} 2>&1 | tee "$OUT/cpu_tests.log" | tail -6 ;;
    probe)
      timeout 120 python3 bench/pcie_probe.py 2>&1 | tee "$OUT/pcie_probe.log" ;;
    attn)
      mkdir -p "$OUT/attn512" "$OUT/attn256"  # ATTN_AB=0: only the engine's own settings
      jit=--no-jit; [ "${ATTN_JIT:-0}" = 1 ] && jit=  # ATTN_JIT=1: also the first-call JIT times (fresh processes)
      timeout 320 python3 bench/cpu_attention.py $jit --reps 10 --dtypes ${ATTN_DTYPES:-bf16,int8} ${ATTN_ARGS:-} --out "$OUT/attn512" \
        > "$OUT/attn512/stdout.log" 2>&1; tail -6 "$OUT/attn512/stdout.log"
      [ "${ATTN_AB:-1}" = 1 ] || continue
      host=$(python3 -c "from numba.core.codegen import get_host_cpu_features as f; print(f())")
      NUMBA_CPU_FEATURES="$host" timeout 200 python3 bench/cpu_attention.py --no-jit --reps 10 \
        --dtypes ${ATTN_DTYPES:-bf16,int8} --out "$OUT/attn256" > "$OUT/attn256/stdout.log" 2>&1
      tail -6 "$OUT/attn256/stdout.log" ;;
    gpudecode)
      timeout ${GPUDECODE_TIMEOUT:-300} python3 bench/gpu_decode.py --out "$OUT" --budget-s 150 ${GPUDECODE_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_decode_stdout.log" | grep -v "^20..-" | tail -${GPUDECODE_TAIL:-32} ;;
    mma)
      timeout ${MMA_TIMEOUT:-330} python3 bench/nf4_mma.py --out "$OUT" ${MMA_ARGS:-} 2>&1 \
        | tee "$OUT/nf4_mma_stdout.log" | grep -v "^20..-" | tail -${MMA_TAIL:-75} ;;
    trace)
      for w in ${TRACE:-"8k bf16"}; do
        timeout 150 python3 bench/step_trace.py --workload "${w//_/ }" --profile "${TRACE_PROFILE:-$OUT/profile.json}" 2>&1 \
          | grep -v "^20..-" | tail -18
      done ;;
    kvattn)
      timeout ${KVATTN_TIMEOUT:-200} python3 -m bench.gpu_kv_attention --out "$OUT/gpu_kv_attention.json" 2>&1 \
        | tee "$OUT/gpu_kv_attention.log" | tail -${KVATTN_TAIL:-16} ;;
    budget)
      timeout ${BUDGET_TIMEOUT:-420} python3 -m bench.budget --out "$OUT" ${BUDGET_ARGS:-} 2>&1 \
        | tee "$OUT/budget_stdout.log" | tail -${BUDGET_TAIL:-10} ;;
    offload)
      timeout ${OFFLOAD_TIMEOUT:-380} python3 bench/offload_decode.py --out "$OUT" ${ONLY:+--only "$ONLY"} ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_stdout.log" | grep -v "^20..-" | tail -30 ;;
  esac
done
