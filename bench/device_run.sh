#!/usr/bin/env bash
# One device-tool call: GPU tests, then the heterogeneous decode benchmark. Logs under $OUT.
#   bash bench/device_run.sh [pytest-paths...]       (carry .whl: bitsandbytes for the NF4 kernels)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, numba, transformers; print('torch', torch.__version__, 'numba', numba.__version__, 'transformers', transformers.__version__)"
tests=${*:-tests/test_offload_gpu.py tests/test_gpu_ops.py}
timeout 170 python3 -m pytest -q -m gpu $tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 380 python3 bench/offload_decode.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_stdout.log" | grep -v "^20..-" | tail -30
