#!/usr/bin/env bash
# The one device check on one GPU (see README "GPU"): the suite's one-device tests (-m gpu) on the
# GPU (the fused Pallas kernel compiled by Triton included), then the kernel benchmark
# (benchmarks/gpu_kernels.py: jax_cp's kernels, pallas_gpu among them, vs cuDNN, causal bf16,
# S = 8K-64K), then the linear layers' chunked forms against their token-by-token scan
# (benchmarks/linear_speed.py: forward + backward, S = 8K, head size 128). Runs with the machine's own
# python3 and its jax with the CUDA plugin (a GPU machine here has no package index: nothing is
# installed; jax_cp runs from this checkout via PYTHONPATH). Writes env.txt, tests.txt, kernels.log,
# kernels.md and linear.txt to $OUT (default ./gpu-check); about 6 min, at most 9 (each step has its
# timeout: 240 s of tests, 210 s of kernel benchmark, 90 s of linear layers).
#
#   bash benchmarks/gpu/check.sh                                    # on the GPU machine
#   CHECK_PLATFORM=cpu CHECK_QUICK=1 bash benchmarks/gpu/check.sh   # the same steps on a CPU (smoke run)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-check}"
PY="${PYTHON:-python3}"
PLATFORM="${CHECK_PLATFORM:-cuda}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS="$PLATFORM"
start=$SECONDS
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    "$PY" -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra --strict-markers" tests/test_gpu.py \
    tests/test_pallas_gpu.py \
    > "$OUT/tests.txt" 2>&1
echo "tests: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/tests.txt"
tail -n 3 "$OUT/tests.txt"

quick=()
[ -n "${CHECK_QUICK:-}" ] && quick=(--quick)
timeout 210 "$PY" benchmarks/gpu_kernels.py "${quick[@]}" --out "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1
echo "kernels: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/kernels.log"
cat "$OUT/kernels.md" 2>/dev/null

linear=(--dk 128 --dv 128)
[ -n "${CHECK_QUICK:-}" ] && linear=(--seq 256 --heads 2 --dk 16 --dv 16 --chunk 16)
timeout 90 "$PY" benchmarks/linear_speed.py "${linear[@]}" --backward --repeat 3 > "$OUT/linear.txt" 2>&1
rc=$?
cat "$OUT/linear.txt"
echo "linear: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/linear.txt"
