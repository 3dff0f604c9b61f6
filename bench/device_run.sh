#!/usr/bin/env bash
# One device-tool call: the stages named in STAGES (default "tests offload"), logs under $OUT; each
# benchmark runs as `python3 -m bench.NAME` from the repository root (see `python3 -m bench.run`).
#   STAGES="tests attn offload" bash bench/device_run.sh [pytest-paths...]   (carry .whl: bitsandbytes)
# tests:    the GPU tests (default: every test file with tests marked gpu)
# cputests: the CPU kernel tests on this host's CPU (its vector width and VNNI; CPUTESTS_K: a pytest -k filter)
# profile:  `hetero profile --refresh` with empty Numba, Triton and profile caches (a fresh machine's first
#           run: the kernels compile), then again with them filled; wall times printed
# attn:     bench.cpu_attention for bf16 and int8 (ATTN_DTYPES; ATTN_JIT=1: with the first-call JIT times;
#           ATTN_ARGS passed through, e.g. "--threads 8 --int8-sweep 64:2,128:4")
# gpudecode: bench.gpu_decode (all-GPU decode and prefill, per-linear NF4 kernels; GPUDECODE_ARGS="--only b1")
# gemv:     bench.nf4_gemv (NF4 GEMV at decode shapes: bitsandbytes, Triton, the tensor-core kernel; GEMV_ARGS
#           passed through, default "--rows 1,2,5,8 --sweep --step")
# mma:      bench.nf4_mma (the W4A16 tensor-core kernel's sweep at 4-64 rows vs bitsandbytes; MMA_ARGS passed through)
# kvattn:   bench.gpu_kv_attention (paged decode attention over bf16 / int8 / int4 device blocks, GB/s vs HBM;
#           KVATTN_ARGS passed through, e.g. "--rows 1,4,8 --launch 4x2,8x2")
# offload:  bench.offload_decode (ONLY="8k bf16,32k int8" picks workloads; BENCH_ARGS passed through)
# startup8b: bench.startup on a Llama-3-8B-shaped Q4_K_M GGUF it writes first (carry .dbg/tok.gguf from
#           `python3 -m bench.startup --tokenizer-only .dbg/tok.gguf`), twice: cold caches, then warm
# spec:     bench.speculative: speculative decoding on the Llama-3-8B shape at each SPEC_DEPTH (default 32768)
#           context, --gpu-mem SPEC_GPU_MEM (default 6GiB), the planner's own placement: drafts off,
#           fed-in acceptances 3/4 and 0/auto (drafts of the adaptive length, none kept), and ngram (SPEC_DRAFTS; SPEC_ARGS passed through, e.g. "--trace $OUT/spec")
# budget:   bench.budget (decode at each --gpu-mem budget, the planner's own choice; BUDGET_ARGS passed through,
#           e.g. "--only 1x8k@6GiB --weights q4")
# grouped:  bench.moe_grouped (the MoE prefill's grouped 4-bit GEMM on Qwen3-30B-A3B's shapes; GROUPED_ARGS="--sweep")
# dramshare: bench.dram_share (the CPU's expert kernel and the GPU's reads of pinned memory, alone and at once)
# streamcopies: bench.stream_copies (a layer's streamed host KV pieces: a call each, one batched call, a kernel;
#           STREAMCOPIES_ARGS="--rows 32")
# omp:      bench.omp_pools (what a second OpenMP pool, Numba's or torch's, costs three small Numba regions)
# moe:      bench.moe (mixture-of-experts decode and prefill at each --gpu-mem budget, the planner's own choice;
#           MOE_ARGS passed through, e.g. "--only qwen3@8GiB --steps 16")
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
      [ $# -gt 0 ] || set -- $(grep -l "mark.gpu" tests/test_*.py)  # every file with GPU tests (~6 min on an H100)
      timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -q -m gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
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
    cputests)
      timeout ${CPUTESTS_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_simd.py tests/test_cpu_attention.py \
        ${CPUTESTS_K:+-k "$CPUTESTS_K"} 2>&1 | tee "$OUT/cpu_tests.log" | tail -6 ;;
    attn)
      mkdir -p "$OUT/attn"
      jit=--no-jit; [ "${ATTN_JIT:-0}" = 1 ] && jit=  # ATTN_JIT=1: also the first-call JIT times (fresh processes)
      timeout 320 python3 -m bench.cpu_attention $jit --reps 10 --dtypes ${ATTN_DTYPES:-bf16,int8} ${ATTN_ARGS:-} \
        --out "$OUT/attn" > "$OUT/attn/stdout.log" 2>&1; tail -6 "$OUT/attn/stdout.log" ;;
    gpudecode)
      timeout ${GPUDECODE_TIMEOUT:-300} python3 -m bench.gpu_decode --out "$OUT" --budget-s 150 ${GPUDECODE_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_decode_stdout.log" | grep -v "^20..-" | tail -${GPUDECODE_TAIL:-32} ;;
    gemv)
      timeout ${GEMV_TIMEOUT:-300} python3 -m bench.nf4_gemv --out "$OUT/gemv" ${GEMV_ARGS:---rows 1,2,5,8 --sweep --step} 2>&1 \
        | tee "$OUT/gemv_stdout.log" | grep -v "^20..-" | tail -${GEMV_TAIL:-40} ;;
    mma)
      timeout ${MMA_TIMEOUT:-330} python3 -m bench.nf4_mma --out "$OUT" ${MMA_ARGS:-} 2>&1 \
        | tee "$OUT/nf4_mma_stdout.log" | grep -v "^20..-" | tail -${MMA_TAIL:-75} ;;
    kvattn)
      timeout ${KVATTN_TIMEOUT:-200} python3 -m bench.gpu_kv_attention --out "$OUT/gpu_kv_attention.json" ${KVATTN_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_kv_attention.log" | tail -${KVATTN_TAIL:-16} ;;
    startup8b)
      tok=.dbg/tok.gguf; [ -f "$tok" ] || tok=
      timeout 300 python3 -m bench.startup --write-8b /tmp/l3.gguf ${tok:+--tokenizer-from $tok} --device cuda 2>&1 \
        | tee "$OUT/startup8b_cold.log" | tail -14
      timeout 200 python3 -m bench.startup /tmp/l3.gguf --device cuda 2>&1 | tee "$OUT/startup8b_warm.log" | tail -14 ;;
    spec)
      for depth in ${SPEC_DEPTH:-32768}; do
        timeout ${SPEC_TIMEOUT:-300} python3 -m bench.speculative --ctx $depth --gpu-mem ${SPEC_GPU_MEM:-6GiB} \
          --steps ${SPEC_STEPS:-128} --drafts ${SPEC_DRAFTS:-off,3/4,0/auto,ngram} --out "$OUT/speculative_$depth.json" ${SPEC_ARGS:-} 2>&1 \
          | tee "$OUT/speculative_$depth.log" | tail -8
      done ;;
    moe)
      timeout ${MOE_TIMEOUT:-500} python3 -m bench.moe --out "$OUT" ${MOE_ARGS:-} 2>&1 \
        | tee "$OUT/moe_stdout.log" | tail -${MOE_TAIL:-10} ;;
    grouped)
      timeout ${GROUPED_TIMEOUT:-300} python3 -m bench.moe_grouped ${GROUPED_ARGS:-} 2>&1 | tee "$OUT/moe_grouped.log" | tail -${GROUPED_TAIL:-50} ;;
    dramshare)
      timeout ${DRAMSHARE_TIMEOUT:-200} python3 -m bench.dram_share 2>&1 | tee "$OUT/dram_share.log" | tail -8 ;;
    streamcopies)
      timeout 120 python3 -m bench.stream_copies ${STREAMCOPIES_ARGS:-} 2>&1 | tee "$OUT/stream_copies.log" | tail -10 ;;
    omp)
      timeout 120 python3 -m bench.omp_pools 2>&1 | tee "$OUT/omp_pools.log" | tail -5 ;;
    budget)
      timeout ${BUDGET_TIMEOUT:-420} python3 -m bench.budget --out "$OUT" ${BUDGET_ARGS:-} 2>&1 \
        | tee "$OUT/budget_stdout.log" | tail -${BUDGET_TAIL:-10} ;;
    offload)
      timeout ${OFFLOAD_TIMEOUT:-380} python3 -m bench.offload_decode --out "$OUT" ${ONLY:+--only "$ONLY"} ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_stdout.log" | grep -v "^20..-" | tail -30 ;;
  esac
done
