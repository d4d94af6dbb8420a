#!/bin/bash
# throwaway: ncu stall profile of the 1x4K decode launches and the 32K quantize launch
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set -x
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis"
timeout 150 ncu --clock-control none -k regex:oscar_decode --launch-skip 2 --launch-count 2 $S -o $OUT/dec -f python3 benchmarks/ncu_kernels.py decode --tokens 4096 --calls 3 2>&1 | tail -5
timeout 150 ncu --clock-control none -k regex:oscar_quantize --launch-skip 1 --launch-count 1 $S -o $OUT/qnt -f python3 benchmarks/ncu_kernels.py quantize --tokens 32768 --calls 2 2>&1 | tail -5
for r in dec qnt; do
  ncu --import $OUT/$r.ncu-rep --print-details all > $OUT/$r.details.txt 2>&1
  ncu --import $OUT/$r.ncu-rep --page source --print-source sass --csv > $OUT/$r.sass.csv 2>&1
  ls -la $OUT/$r*; head -c 600 $OUT/$r.sass.csv; echo
done
grep -E "Duration|Registers|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued" $OUT/*.details.txt
