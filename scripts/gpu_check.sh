#!/usr/bin/env bash
# The prepared GPU check, in two parts that each take under 5 minutes on an H200:
#   bash scripts/gpu_check.sh 1   engine checks (scripts/gpu_check.py) + the GPU-only tests (pytest -m gpu)
#   bash scripts/gpu_check.sh 2   the CUDA sweep through the harness CLI: a model whose experts do not fit
#                                 hardware.device_memory, default run settings (reference check, ablation)
#   bash scripts/gpu_check.sh     both
# Rows are written as they are produced (gpu_check.csv is appended and flushed per row), every
# command runs under `timeout`, and one failing command never stops the next; the exit status is
# non-zero if anything failed. Output goes to $OUT (device tool) or results/gpu/<date>/.
#
# On the lent device machine (Python 3.12, torch/transformers/pandas/pyarrow/cupy/pytest present;
# hydra-core, omegaconf, antlr4 and nvtx missing, no network): first, here,
#   mkdir -p .device-site && cp ../shared/wheels/py312/*.whl .device-site/
# then run `bash scripts/gpu_check.sh 1` (or 2) with carry=[".device-site"].
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
case "$PART" in 1|2|all) ;; *) echo "usage: $0 [1|2]  (1: engine checks + pytest -m gpu, 2: CUDA sweep; none: both)" >&2; exit 2;; esac
# the device tool brings back at most 8 files from $OUT: part 1 writes 5, part 2 writes 8, both 11
if [ "$PART" = all ] && [ -n "${OUT:-}" ]; then
  echo "under the device tool (\$OUT set) run part 1 and part 2 as separate calls: together they write" \
       "11 files to \$OUT, and the tool brings back 8" >&2
  exit 2
fi
DATE=$(date +%Y-%m-%d)
DEST=${OUT:-results/gpu/$DATE}
mkdir -p "$DEST"
if ls .device-site/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-site/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
status=0
step() {   # step NAME SECONDS CMD...: run under timeout, log to $DEST/NAME.log, record its exit status
  local name=$1 limit=$2; shift 2
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$DEST/$name.log") 2>&1
  local rc=$?
  echo "$name,$rc" >> "$DEST/steps.csv"
  [ $rc -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}
[ -f "$DEST/steps.csv" ] || echo "step,exit_status" > "$DEST/steps.csv"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$DEST/nvidia_smi.csv" 2>&1 || true

if [ "$PART" = 1 ] || [ "$PART" = all ]; then
  step engine_checks 220 python3 scripts/gpu_check.py --out "$DEST/gpu_check.csv"
  step pytest_gpu 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_static_decode.py tests/harness/test_manifest.py tests/harness/test_measure.py
fi

if [ "$PART" = 2 ] || [ "$PART" = all ]; then
  # OLMoE shapes, 4 layers, bf16: 4 x 64 experts x 12 MiB = 3 GiB of experts against a 2 GiB device budget.
  REAL="model=olmoe-1b-7b model.num_layers=4 model.dtype=bfloat16 hardware.device=cuda hardware.device_memory=2GiB"
  REAL="$REAL workload=chat workload.context_tokens=1024 workload.gen_tokens=32 run.repeats=2 run.quiet=true"
  step sweep_placements 170 python3 -m harness.cli -m $REAL placement=fetch,stream,cpu cache.capacity=auto \
    run.out=/tmp/gpu_results run.sweep_id=cuda_placements
  step sweep_prefetch 100 python3 -m harness.cli -m $REAL placement=fetch cache.capacity=auto prefetch=next_layer_gate \
    run.out=/tmp/gpu_results run.sweep_id=cuda_prefetch
  for s in cuda_placements cuda_prefetch; do
    cp /tmp/gpu_results/sweeps/$s/summary.csv "$DEST/${s}_summary.csv" 2>/dev/null || { echo "!! no summary for $s"; status=1; }
    cp /tmp/gpu_results/sweeps/$s/results.parquet "$DEST/${s}.parquet" 2>/dev/null || status=1
  done
fi
exit $status
