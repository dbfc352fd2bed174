#!/usr/bin/env bash
# One device call for issue #6's proof (see benchmarks/results/hopper_kernel.md for how it is
# built): kernel-level numerics + timings, the pipeline cases on the Hopper kernel, and the
# pipeline-level benchmark. Everything lands in $OUT/run.tgz (the tool returns at most 8 files).
# Carry: .gpu/site $KERNEL_DIR/libhopper_test.so $KERNEL_DIR/manifest.json (KERNEL_DIR defaults
#        to .gpu/hopper_run3) .gpu/cases_hopper .gpu/bench .gpu/models (a missing directory's
#        step is skipped). STACKFUSE_BENCH_ROUNDS sets both benchmarks' rounds (default 5);
#        KERNEL_SHAPES picks the kernel benchmark's shape set (main, sweep, short; default main),
#        BENCH_NAMES the pipeline benchmark's shapes (default: all; name those .gpu/bench holds).
set -uo pipefail
export PYTHONPATH=$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1
res=/tmp/results && mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 benchmarks/hopper_kernel.py run --dir "${KERNEL_DIR:-.gpu/hopper_run3}" --out "$res/kernel" \
  --budget "${KERNEL_BUDGET:-300}" --shapes "${KERNEL_SHAPES:-main}" 2>&1 | tee "$res/kernel.log" | tail -40
if [ -d .gpu/cases_hopper ]; then
  python3 -m benchmarks.gpu_cases check .gpu/cases_hopper 2>&1 | tee "$res/cases.log" | tail -3
  cp .gpu/cases_hopper/numerics.json "$res/cases_hopper_numerics.json"
fi
if [ -d .gpu/models ]; then
  python3 -m benchmarks.models_gpu check .gpu/models "$res/models" 2>&1 | tee "$res/models.log" | tail -12
fi
if [ -d .gpu/bench ]; then
  # shellcheck disable=SC2086  # BENCH_NAMES: a list of shape names
  python3 -m benchmarks.attention_bench run .gpu/bench ${BENCH_NAMES:-} 2>&1 | tee "$res/bench.log" | tail -25
  cp .gpu/bench/attention_bench.json .gpu/bench/attention_bench.md "$res/"
fi
tar czf "$OUT/run.tgz" -C "$res" .
cp "$res/kernel/hopper_kernel.md" "$res/attention_bench.md" "$OUT/" 2>/dev/null
