#!/usr/bin/env bash
# The whole device run of issue 28, for a machine with a CUDA GPU whose python3 has torch and triton:
# bsrkit from this source tree; correctness (niced) beside tuning + timings; a CPU test subset on that torch.
# Writes 8 files under $OUT (the device tool's limit). Usage: OUT=/some/dir bash benchmarks/gpu_check_run.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 BSRKIT_TUNING_TABLE=/tmp/bsrkit-tuning.json
python3 -c "import bsrkit, torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)" || exit 3
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT/c" "$OUT/s"
[ -n "${SKIP_PYTEST:-}" ] || (TRITON_INTERPRET=1 OMP_NUM_THREADS=4 NUMBA_NUM_THREADS=4 nice -n 15 timeout 360 python3 -m pytest -q -x \
  -m "not triton" -p no:cacheprovider tests/test_products.py tests/test_autograd.py tests/test_nn.py \
  > "$OUT/pytest.txt" 2>&1) &
tests=$!
nice -n 5 timeout 370 python3 benchmarks/gpu_check.py --out "$OUT/c" --sections correctness --budget 330 \
  > /dev/null 2> "$OUT/c.err" &
checks=$!
timeout 380 python3 benchmarks/gpu_check.py --out "$OUT/s" --sections tune,speed,attention --budget 350 \
  ${GPU_CHECK_ARGS:-} \
  > /dev/null 2> "$OUT/s.err"
wait "$checks"
wait "$tests"
echo "== correctness"; grep -E "FAIL|failures|step" "$OUT/c/gpu_check.log" | cut -c1-300 | tail -40
echo "== timings"; grep -v "tune skip" "$OUT/s/gpu_check.log" | grep -v "^attention {" | tail -140
[ -n "${SKIP_PYTEST:-}" ] || { echo "== pytest (CPU, this torch)"; tail -4 "$OUT/pytest.txt"; }
