#!/usr/bin/env bash
# One call on a GPU machine: install, run the CUDA tests, then a short GPU benchmark.
# Usage (device tool): bash scripts/gpu_check.sh   -- results land in $OUT (or ./gpu-results).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python3 -m venv /tmp/ds-venv && . /tmp/ds-venv/bin/activate
pip install -q torch numpy pytest psutil 2>&1 | tail -2   # the machine's CUDA build of torch
pip install -q --no-deps -e . 2>&1 | tail -2
nvidia-smi -L | tee "$OUT/gpu.txt"
python -m pytest tests/gpu tests/unit -q -x 2>&1 | tee "$OUT/tests.txt" | tail -15
python benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -30
