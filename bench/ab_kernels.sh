#!/usr/bin/env bash
# A/B of kernel versions on one machine: trees given as args (each with cpu_attention/ and bench/),
# interleaved rounds of bench/cpu_kernel_parts.py (1 thread, KV in cache, the whole kernel) and
# bench/cpu_scaling.py (16 threads, KV from DRAM), for AB_DTYPE (int8, the default, or int4).
# Logs under $OUT/ab.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ab"
for round in ${ROUNDS:-1 2 3}; do
  for tree in "$@"; do
    tag=$(basename "$tree"); export NUMBA_CACHE_DIR=/tmp/nb_ab_$tag
    ns=$(timeout 120 python3 "$tree/bench/cpu_kernel_parts.py" --dtypes ${AB_DTYPE:-int8} --variants full --reps 20 2>&1 | tail -1)
    echo "round $round $tag kparts: $ns" | tee -a "$OUT/ab/summary.log"
    if [ "$round" != 3 ]; then
      timeout 150 python3 "$tree/bench/cpu_scaling.py" --threads 16 --dtypes ${AB_DTYPE:-int8} --reps 20 > "$OUT/ab/scaling_${tag}_$round.log" 2>&1
      echo "round $round $tag scaling: $(tail -1 "$OUT/ab/scaling_${tag}_$round.log")" | tee -a "$OUT/ab/summary.log"
    fi
  done
done
