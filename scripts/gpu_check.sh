#!/usr/bin/env bash
# One prepared GPU check: every placement on CUDA (invariant vs resident), pinned host store,
# copy stream + events, peak device memory, a CUDA sweep through the harness, and the
# GPU-only tests. Writes tidy tables into $OUT (device tool) or results/gpu/<date>/.
#
# On the lent device machine (Python 3.12, torch/transformers/pandas/pyarrow/cupy present;
# hydra-core, omegaconf, antlr4 and nvtx missing): first, here,
#   mkdir -p .device-site && cp ../shared/wheels/py312/*.whl .device-site/
# then run `bash scripts/gpu_check.sh` with carry=[".device-site"].
set -uo pipefail
cd "$(dirname "$0")/.."
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
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$DEST/nvidia_smi.csv"
status=0
python3 scripts/gpu_check.py --out "$DEST/gpu_check.csv" || status=1
python3 -m harness.cli -m hardware.device=cuda placement=resident,fetch,cpu,hybrid,stream cache.capacity=2,4 \
  workload=chat workload.context_tokens=1024 run.repeats=3 run.quiet=true run.out=/tmp/gpu_results run.sweep_id=cuda || status=1
cp /tmp/gpu_results/sweeps/cuda/summary.csv "$DEST/cuda_sweep_summary.csv" 2>/dev/null || status=1
cp /tmp/gpu_results/sweeps/cuda/results.parquet "$DEST/cuda_sweep.parquet" 2>/dev/null || status=1
python3 -m pytest -q -m gpu tests 2>&1 | tee "$DEST/pytest_gpu.txt" | tail -5 || status=1
exit $status
