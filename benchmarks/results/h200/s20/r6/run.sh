set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
echo "== GPU tests"; date
timeout 150 python3 -m pytest -q -n 4 -k GPU tests/test_quantize_kernel.py tests/test_cache_write.py > $OUT/gpu_tests.txt 2>&1; tail -1 $OUT/gpu_tests.txt
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r oscar_jax pallas_kernels benchmarks /tmp/base/ && cp _s20/base_quantize.py /tmp/base/pallas_kernels/quantize.py && cp _s20/base_quantize_numerics.py /tmp/base/pallas_kernels/quantize_numerics.py
for round in 1 2; do
echo "== base $round"; (cd /tmp/base && PYTHONPATH=. timeout 100 python3 benchmarks/bench_quantize.py --bench --variants pallas --out $OUT/base$round 2>&1 | grep "| pallas")
echo "== fma $round"; timeout 100 python3 benchmarks/bench_quantize.py --bench --variants pallas --out $OUT/fma$round 2>&1 | grep "| pallas"
done
echo "== sass"; timeout 120 ncu --clock-control none -k regex:oscar_quantize --launch-count 1 --section LaunchStats -o /tmp/rep_fma -f python3 benchmarks/ncu_kernels.py quantize --tokens 32768 > /tmp/ncu.log 2>&1
ncu -i /tmp/rep_fma.ncu-rep --page source --print-source sass --csv > $OUT/sass_fma.csv 2>&1
ncu -i /tmp/rep_fma.ncu-rep --page details 2>&1 | grep -E "Registers Per|Dynamic Shared" | tr -s ' '
python3 benchmarks/sass_offline.py ncu $OUT/sass_fma.csv | head -1
date
