set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mk() { # name prefix
  rm -rf /tmp/t_$1 && mkdir -p /tmp/t_$1 && cp -r oscar_jax pallas_kernels benchmarks /tmp/t_$1/
  for f in codec.py; do cp _s20/$2_$f /tmp/t_$1/oscar_jax/$f; done
  for f in quantize.py quantize_numerics.py quantize_rotation.py; do cp _s20/$2_$f /tmp/t_$1/pallas_kernels/$f; done
}
one() { # name prefix env opts
  mk $1 $2
  (cd /tmp/t_$1 && env $3 timeout 150 ncu --clock-control none -k regex:oscar_quantize --launch-count 1 --section LaunchStats -o /tmp/rep_$1 -f python3 benchmarks/ncu_kernels.py quantize --tokens 32768 --options "$4" > /tmp/ncu_$1.log 2>&1)
  ncu -i /tmp/rep_$1.ncu-rep --page source --print-source sass --csv > $OUT/sass_$1.csv 2>&1
  ncu -i /tmp/rep_$1.ncu-rep --page details 2>&1 | grep -E "Registers Per|Dynamic Shared" | tr -s ' ' | tr '\n' ' '; echo " <- $1 ($(wc -l < $OUT/sass_$1.csv) sass lines)"
}
one base base X=1 '{}'
one dot4 new OSCAR_NORM_VIA=dot '{}'
one load2 new OSCAR_NORM_VIA=load '{"groups_per_block": 2}'
