set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
echo "== GPU tests"; date
timeout 220 python3 -m pytest -q -n 4 -k GPU tests/test_quantize_kernel.py tests/test_cache_write.py > $OUT/gpu_tests.txt 2>&1; tail -4 $OUT/gpu_tests.txt
echo "== base"; date
mkdir -p /tmp/base && cp -r oscar_jax pallas_kernels benchmarks /tmp/base/ && cp _s20base/codec.py /tmp/base/oscar_jax/ && cp _s20base/quantize*.py /tmp/base/pallas_kernels/
(cd /tmp/base && PYTHONPATH=. timeout 120 python3 benchmarks/bench_quantize.py --bench --variants pallas --out $OUT/base 2>&1 | grep -v "^{" | tail -8)
echo "== new"; date
timeout 200 python3 benchmarks/bench_quantize.py --check --bench --variants "$1" --out $OUT/new 2>&1 | grep -v "^{" | tail -14
date
