#!/usr/bin/env bash
# The GPU checks of issue 18 in one run (~6 minutes on an H200; README "GPU (H200)" has the results):
#   1. the Pallas tests that need a GPU (the real Triton kernels against the references, the dispatch to them);
#      the interpret-mode tests are CPU work (CI): run on the GPU backend they took > 2 minutes (2026-12-04),
#   2. experiments/benchmarks/gpu_kernels.py: kernel checks, SWA vs cuDNN at T = 4K / 16K / 32K, gmm vs ragged_dot
#      at 2K / 16K tokens, a block / tile sweep,
#   3. experiments/benchmarks/gpu_model.py: a 4-layer real-width training step (tokens/s, MFU), decode at batch 64.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, jax, jaxlib, flax, optax, importlib.metadata as m; print(sys.version.split()[0], jax.__version__, \
jaxlib.__version__, flax.__version__, optax.__version__, m.version('triton'), jax.devices())"
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" || { echo "no GPU for jax here"; exit 1; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log with timestamps
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
}
{
  XLA_PYTHON_CLIENT_PREALLOCATE=false step pytest 100 python3 -m pytest -q -p no:cacheprovider -n 6 -W ignore \
    tests/test_pallas_attention.py tests/test_pallas_grouped_matmul.py -k "on_device or dispatch" -rs
  step kernels 170 python3 experiments/benchmarks/gpu_kernels.py --budget_s 100 --sweep --out "$OUT/kernels.json"
  # batch 2 x 4096: the state (6.4B bf16 parameters, Muon) and activations fit with room; 4 x 4096 with the "xla"
  # MoE path asked for 157 GiB (its tiles gather the expert weights).
  XLA_PYTHON_CLIENT_MEM_FRACTION=.95 step model 200 python3 experiments/benchmarks/gpu_model.py \
    --budget_s 120 --out "$OUT/model.json"
} 2>&1 | grep -v PytestBenchmarkWarning | tee "$OUT/log.txt"
