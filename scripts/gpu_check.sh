#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (CI has none). From the repo root:
#
#     bash scripts/gpu_check.sh            # results into results/ (or $OUT when set)
#
# 1. builds the CUDA flavour in place (nvcc; torch built with CUDA);
# 2. runs every `cuda`-marked test: the SyncBatchNorm parity matrix, sweep and
#    numerics on CUDA tensors over gloo (all ranks share the one GPU, which NCCL
#    refuses), and the CUDA kernels against the pure-torch reference;
# 3. benchmarks ours against nn.SyncBatchNorm on CUDA, 2 and 4 ranks over gloo
#    (same world size and backend), JSON and a table.
# Each step's output goes to the terminal and to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
PY="${PYTHON:-python3}"
status=0
step() {
  echo "=== $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== exit $rc: $*" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}
: > "$LOG"
step "$PY" -c "import torch; print(torch.__version__, torch.version.cuda); assert torch.cuda.is_available(), 'no GPU'" || exit 1
step env RINGREDUCE_CUDA=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" setup.py -q build_ext --inplace || exit 1
step "$PY" -c "from torch_ringreduce import _C; from torch_ringreduce.sync_batchnorm import kernel_source; assert _C.with_cuda, 'not a CUDA build'; print(kernel_source('cuda'))"
step "$PY" -m pytest -q -m cuda -s tests/test_sync_batchnorm.py tests/test_cuda_build.py
step "$PY" scripts/bench_syncbn.py --device cuda --backend gloo --nproc 2 4 \
  --json "$OUT_DIR/bench_syncbn_cuda.json"
echo "gpu_check: exit $status (log: $LOG)"
exit $status
