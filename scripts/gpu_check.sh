#!/usr/bin/env bash
# One call on a GPU machine (no network there; its python3 already has torch+CUDA, pytest, numpy):
# run the CUDA tests and the unit tests on that torch, then a short GPU benchmark.
# With the device tool: run(command="bash scripts/gpu_check.sh", timeout_s=540); results in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest tests/gpu tests/unit -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -15
timeout 200 python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -30
