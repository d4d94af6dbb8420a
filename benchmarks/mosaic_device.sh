#!/usr/bin/env bash
# One device call for the Mosaic GPU decode kernel: the GPU correctness tests, the timing
# sweep (benchmarks.bench_mosaic) and the compiler's SASS / register report of every kernel
# the sweep compiles, packed under $OUT (at most 8 files come back from a device call).
#   bash benchmarks/mosaic_device.sh SHAPES "VARIANT;VARIANT..." [TEST_FILTER] [MOSAIC_JSON]
# SHAPES and VARIANTs as benchmarks.bench_mosaic takes them; TEST_FILTER a pytest -k
# expression for tests/test_decode_mosaic.py (default: all GPU tests; "none" skips them).
# MOSAIC_JSON: also run benchmarks.bench_decode over its four shapes with the Mosaic kernel
# of these knobs beside the Triton INT2, BF16, XLA and cuDNN peers (into $OUT/decode).
# DUMP=1 keeps the compiler's reports and PTX (several MB).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out/mosaic_device}
mkdir -p "$OUT"
shapes=$1
variants=$2
filter=${3:-GPU}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv | tee "$OUT/gpu.txt"
if [ "$filter" != none ]; then
  # PYTEST_ARGS (e.g. "-n 4": xdist workers share the GPU), TEST_TIMEOUT seconds (200)
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q tests/test_decode_mosaic.py -k "$filter" \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
mkdir -p /tmp/mgdump
if [ "${DUMP:-0}" = 1 ]; then
  export MOSAIC_GPU_DUMP_TO=/tmp/mgdump MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1
fi
if [ "$variants" != none ]; then
  TAG=bench OUT="$OUT" timeout 300 python3 -m benchmarks.bench_mosaic "$shapes" "$variants" \
    2>&1 | grep -v "^{" | tail -20
fi
if [ -n "${4:-}" ]; then
  timeout 300 python3 -m benchmarks.bench_decode --out "$OUT/decode" --no-gqa --check \
    --mosaic "$4" --shapes "${DECODE_SHAPES:-1x131072,8x32768,48x4096,1x4096}" 2>&1 | tail -25
fi
# the compiler's report (registers, spills, wgmma serialisation warnings) and the PTX, for
# offline SASS with ptxas / nvdisasm on a CPU machine
[ "${DUMP:-0}" = 1 ] && (cd /tmp/mgdump && find . -type f | sort > "$OUT/dump_files.txt"
 find . -type f \( -name "*ptxas*" -o -name "*.ptx" \) -print0 | xargs -0 tar czf "$OUT/ptx.tgz")
[ "${DUMP:-0}" = 1 ] && grep -rh -A3 "registers\|serializ\|spill" /tmp/mgdump 2>/dev/null | sort | uniq -c | sort -rn \
  | head -40 > "$OUT/ptxas_summary.txt"
ls -la "$OUT"
