#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (CI has none). From the repo root:
#
#     bash scripts/gpu_check.sh                 # every step below, results into results/ ($OUT when set)
#     bash scripts/gpu_check.sh build tests     # only some steps (build is implied by the others)
#
# Steps:
#   env      the GPU, torch, CUDA and the NCCL torch loads
#   build    the CUDA flavour in place (nvcc; torch built with CUDA)
#   tests    every `cuda`-marked test: collectives on CUDA tensors against gloo
#            (host staging; all ranks share the one GPU), DDP and nn.SyncBatchNorm
#            on ringreduce, errors on CUDA, our SyncBatchNorm's parity matrix,
#            sweep and numerics, the CUDA kernels against the pure-torch reference
#   syncbn   ours against nn.SyncBatchNorm on CUDA, 2 and 4 ranks, over
#            ringreduce and over gloo (the same world size and backend for both)
#   coll     all-reduce and broadcast on CUDA tensors, ringreduce against gloo,
#            2 and 4 ranks, 4 KiB to 256 MiB
#   train    ddp_cifar100.py --device cuda for 2 epochs (synthetic data) on
#            ringreduce and on gloo (torch's DDP and nn.SyncBatchNorm): samples/s,
#            peak memory, accuracy; then on ringreduce with our DDP and our
#            SyncBatchNorm; and demo.py's every-collective table on CUDA tensors
#   studies  the course studies on CUDA tensors: bench_ddp_variants.py (every
#            gradient-sync variant, ringreduce, gloo and nccl) and the course table
#            (bench_collectives.py --course-table, 2 and 4 workers). nccl needs
#            NCCL 2.30+ for two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1 and
#            the nvidia-nccl-cu13 wheel); with an older NCCL its columns say why not.
#   host     issue 10's CPU table on this machine's idle cores (CPU tensors, no GPU
#            involved): the all-reduce at 2 and 4 ranks, 4 KiB-64 MiB, against gloo
#            and Open MPI (when mpirun and mpi4py are there), with the one-rank floor
#            and one core's memcpy measured in the same run. The 2-core development
#            VM cannot reach the 64 MiB target (busbw >= 0.8 of one core's memcpy):
#            its two cores share one core's memory bandwidth (docs/notes.md, "The 2-rank
#            64 MiB all-reduce and the memory"); this step measures it on a server's cores.
# Each step's output goes to the terminal and to $OUT/gpu_check.log; JSON next to it.
# Every step fits the device tool's 10-minute limit when run alone; all of them
# together take about 12 minutes on an H100 machine (16 cores) without `studies`,
# so run them in four calls there: `tests syncbn`, then `coll train`, then
# `studies`, then `host`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
status=0
step() {
  echo "=== $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== exit $rc after $((SECONDS - t0)) s: $*" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}
want() {  # want STEP: whether STEP was asked for (all when none was named)
  [ "$#" -gt 0 ] || return 1
  [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]
}
STEPS="$*"
: >> "$LOG"

want env && {
  step nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  step "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
}
step "$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU'" || exit 1

# Built once per call: every other step needs the CUDA flavour. The extension
# must be compiled by the compiler whose C++ runtime the process loads: a
# toolchain in front of the system one on PATH (/opt/gcc on the lent GPU
# machines, CXX=/opt/gcc/bin/g++) links libstdc++ statically into the
# extension, whose copy then crashed in its first std::ostream insertion
# (a second C++ runtime in a process that loads the system's). The system
# compiler is used where there is one; RINGREDUCE_CXX picks another.
if [ -n "${RINGREDUCE_CXX:-}" ]; then export CXX="$RINGREDUCE_CXX"
elif [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
want env && step bash -c 'echo "CXX=${CXX:-} $(command -v c++ g++ | tr "\n" " ")"; ${CXX:-c++} --version | head -1'
step env RINGREDUCE_CUDA=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS="$(nproc)" \
  "$PY" setup.py -q build_ext --inplace || exit 1
step "$PY" -c "from torch_ringreduce import _C; from torch_ringreduce.sync_batchnorm import kernel_source; assert _C.with_cuda, 'not a CUDA build'; print(kernel_source('cuda'))" || exit 1
# The extension must use the process's one C++ runtime (see CXX above).
step bash -c 'readelf -d torch_ringreduce/_C*.so | grep -q "NEEDED.*libstdc++" || { echo "torch_ringreduce/_C: libstdc++ is linked statically (compiler $CXX): it crashes at run time; set RINGREDUCE_CXX to the system g++"; exit 1; }' || exit 1

want tests && step "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider \
  tests/test_cuda_collectives.py tests/test_sync_batchnorm.py tests/test_traffic.py \
  tests/test_shrink.py
# The compile checks carry no `cuda` marker (CI runs them without a GPU): all of
# them, against the device's own toolkit and torch.
want tests && step "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py

want syncbn && for backend in ringreduce gloo; do
  step "$PY" scripts/bench_syncbn.py --device cuda --backend "$backend" --nproc 2 4 \
    --json "$OUT_DIR/bench_syncbn_cuda_$backend.json"
done

want coll && for n in 2 4; do
  step "$PY" scripts/bench_collectives.py --device cuda --nproc "$n" --backends ringreduce gloo \
    --ops allreduce broadcast -b 4K -e 256M -f 4 --repeats 3 --target-time 0.2 \
    --json "$OUT_DIR/bench_collectives_cuda_np$n.json"
done

want train && for backend in ringreduce gloo; do
  step "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 scripts/ddp_cifar100.py \
    --device cuda --backend "$backend" --ddp torch --sync-bn torch --synthetic \
    --train-size 20000 --val-size 2000 --epochs 2 --batch-size 64 \
    --json "$OUT_DIR/ddp_cifar100_cuda_$backend.json"
done
want train && {
  step "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 scripts/ddp_cifar100.py \
    --device cuda --backend ringreduce --ddp ours --sync-bn ours --synthetic \
    --train-size 20000 --val-size 2000 --epochs 2 --batch-size 64 \
    --json "$OUT_DIR/ddp_cifar100_cuda_ringreduce_ours.json"
  step "$PY" scripts/demo.py --device cuda --nproc 2
}

want studies && {
  step "$PY" scripts/bench_ddp_variants.py --nproc 2 --device cuda --preset small \
    --json "$OUT_DIR/ddp_variants_cuda.json"
  step "$PY" scripts/bench_collectives.py --course-table --device cuda --workers 2 4 \
    --json "$OUT_DIR/course_table_cuda.json"
}
want host && {
  host_backends="ringreduce gloo"
  if command -v mpirun >/dev/null && "$PY" -c "import mpi4py" 2>/dev/null; then
    host_backends="$host_backends mpi"
  else
    echo "=== host: no Open MPI column (mpirun or mpi4py missing)" | tee -a "$LOG"
  fi
  for n in 2 4; do
    # shellcheck disable=SC2086  # one word per backend
    step "$PY" scripts/bench_collectives.py --nproc "$n" --backends $host_backends \
      --ops allreduce -b 4K -e 64M -f 4 --floor --memcpy --repeats 9 \
      --json "$OUT_DIR/bench_collectives_host_np$n.json"
  done
}
echo "gpu_check: exit $status (log: $LOG)"
exit $status
