#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (CI has none). From the repo root:
#
#     bash scripts/gpu_check.sh              # every step below, results into results/ ($OUT when set)
#     bash scripts/gpu_check.sh build tests  # only some steps (build is implied by the others)
#     bash scripts/gpu_check.sh quick        # the short check of one device call (below)
#
# quick: from a bare copy, in under 7 minutes (QUICK_BUDGET_S, default 390 s, bounds
# it: each step's time limit is what the budget leaves it, and a step stopped at
# its limit has 15 s to end), with exit status 0 when
# all passed, 1 when something failed or ran out of time, 2 when there is no GPU
# ("no GPU: nothing to check", at once):
#   1. env      one line: the GPU, torch, its CUDA and NCCL, nvcc, the compiler (60 s)
#   2. build    the CUDA flavour with scripts/tools/build_ext.py on every core (MAX_JOBS=nproc),
#               for the GPU present only (TORCH_CUDA_ARCH_LIST from nvidia-smi's
#               compute_cap unless set), the system g++ (see CXX below); then _C is
#               checked to be a CUDA build with a dynamic libstdc++. A failed build stops
#               the run with the compiler's errors and the build log's last lines
#               (at most 240 s, and 160 s are kept for the rest)
#   3. tests    every `cuda`-marked test (`pytest -m cuda` over the files that mark
#               one), twice: the default data path (host staging), then with the
#               opt-in device data path asked for (the variable in DEVICE_VAR below
#               set to `device`). Whether this build knows that variable is read from
#               its registry (torch_ringreduce.environment(): csrc/common/env.h and
#               torch_ringreduce/_env.py); when it does not, the second pass runs all
#               the same and the summary says "device path: not built (... unknown to
#               this build)". Each pass gets half of what the benchmark leaves (300 s
#               at most); at its limit pytest gets SIGINT, so its junit XML still
#               lists the tests that finished, and the summary names the one running
#   4. bench    torch_ringreduce.bench: all-reduce on 2 ranks sharing the GPU, 4 KiB to
#               256 MiB (64 MiB when time is short): ringreduce (staging) and gloo;
#               nccl when torch's NCCL is 2.30+ (NCCL_MULTI_RANK_GPU_ENABLE=1; an older
#               one is named in the summary); ringreduce on the device path when the
#               build knows it. Each run on its own: a hang costs only that column
#               (about 55 s are kept for the first, 30 s for each other)
#   5. summary  scripts/tools/_gpu_summary.py: pass/fail/skip counts per pass, each failing
#               test with its first error line, the slowest tests, the benchmark table
#               (us and GB/s bus bandwidth) and each step's wall time, on stdout and in
#               $OUT/summary.txt and $OUT/summary.json
# Files in $OUT (6 at most): gpu_check.log (everything), build.log, junit_staging.xml,
# junit_device.xml, summary.txt, summary.json; the rest stays in build/gpu_check_quick.
# One device call: `bash scripts/gpu_check.sh quick` with timeout_s 480 or more.
#
# The other steps (a call naming none runs them all; quick is not one of them):
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
#            (torch_ringreduce.bench --course-table, 2 and 4 workers). nccl needs
#            NCCL 2.30+ for two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1 and
#            the nvidia-nccl-cu13 wheel); with an older NCCL its columns say why not.
#   host     the CPU all-reduce benchmark on this machine's idle cores (CPU tensors,
#            no GPU involved): 2 and 4 ranks, 4 KiB-64 MiB, against gloo and Open MPI
#            (when mpirun and mpi4py are there), with the one-rank floor and one
#            core's memcpy measured in the same run. The 2-core development
#            VM cannot reach the 64 MiB target (busbw >= 0.8 of one core's memcpy):
#            its two cores share one core's memory bandwidth (docs/notes.md, "The 2-rank
#            64 MiB all-reduce and the memory"); this step measures it on a server's cores.
# Each step's output goes to the terminal and to $OUT/gpu_check.log; JSON next to it.
# Every step fits the device tool's 10-minute limit when run alone; all of them
# together take about 12 minutes on an H100 machine (16 cores) without `studies`,
# so run them in four calls there: `tests syncbn`, then `coll train`, then
# `studies`, then `host`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
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
# The extension is built once per call: every other step needs the CUDA flavour.
# It must be compiled by the compiler whose C++ runtime the process loads: a
# toolchain in front of the system one on PATH (/opt/gcc on the lent GPU
# machines, CXX=/opt/gcc/bin/g++) links libstdc++ statically into the
# extension, whose copy then crashed in its first std::ostream insertion
# (a second C++ runtime in a process that loads the system's). The system
# compiler is used where there is one; RINGREDUCE_CXX picks another.
if [ -n "${RINGREDUCE_CXX:-}" ]; then export CXX="$RINGREDUCE_CXX"
elif [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi

# ---------------------------------------------------------------------- quick
# The opt-in device data path's variable, spelled in two parts: tests/test_env.py
# fails on any RINGREDUCE_* name in the source that neither csrc/common/env.h nor
# torch_ringreduce/_env.py declares, and this one is declared only once the device
# path exists. This script only sets it; `quick` asks the build whether it knows it.
DEVICE_VAR="RINGREDUCE_""CUDA_PATH"
QUICK_SIZES=(4K 1M 64M 256M)  # the rows of the summary's benchmark table

quick_no_gpu() {  # prints why there is no GPU to check; fails when there is one
  if ! command -v nvidia-smi >/dev/null 2>&1; then echo "no nvidia-smi"
  elif ! nvidia-smi -L >/dev/null 2>&1; then echo "nvidia-smi finds no GPU"
  elif ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "torch sees no CUDA device"
  else return 1; fi
}

# qstep NAME LIMIT CMD...: CMD stopped after LIMIT seconds (SIGINT, so that pytest
# still writes its junit XML, then SIGKILL 15 s later, to every process it
# started), its output to the terminal, the log and $QWORK/NAME.log, and a line
# in $QWORK/steps.tsv (name, exit status, seconds, limit, $QNOTE).
qstep() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit $limit s): $*" | tee -a "$LOG"
  timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee "$QWORK/$name.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" "$QNOTE" \
    >> "$QWORK/steps.tsv"
  QNOTE=
  return "$rc"
}
qskip() {  # qskip NAME skip|nobudget WHY
  echo "=== $1: skipped: $3" | tee -a "$LOG"
  printf '%s\t%s\t0\t-\t%s\n' "$1" "$2" "$3" >> "$QWORK/steps.tsv"
}
qleft() { echo $((QBUDGET - (SECONDS - QT0))); }
qlimit() {  # qlimit CAP RESERVE: CAP seconds, or fewer so that RESERVE are left after
  local n=$(($(qleft) - $2))
  echo $((n < $1 ? n : $1))
}
# qrun NAME LIMIT CMD...: qstep, or a skip when fewer than 20 s are left for it
qrun() {
  if [ "$2" -lt 20 ]; then
    QNOTE=
    qskip "$1" nobudget "the budget leaves it $2 s (QUICK_BUDGET_S=$QBUDGET)"
    return 1
  fi
  qstep "$@"
}

quick() {
  if [ "$#" -gt 0 ]; then
    echo "gpu_check: quick runs alone (also named: $*)" >&2
    exit 64
  fi
  local why
  if why=$(quick_no_gpu); then
    echo "gpu_check quick: no GPU: nothing to check ($why)" >&2
    exit 2
  fi
  QT0=$SECONDS QBUDGET=${QUICK_BUDGET_S:-390} QWORK=build/gpu_check_quick QNOTE=
  rm -rf "$QWORK" && mkdir -p "$QWORK" || exit 1
  local junit_s="$OUT_DIR/junit_staging.xml" junit_d="$OUT_DIR/junit_device.xml"
  local build_log="$OUT_DIR/build.log" built=0 known=0 nccl=0
  rm -f "$junit_s" "$junit_d" "$build_log" "$OUT_DIR/summary.txt" "$OUT_DIR/summary.json"
  echo "=== gpu_check quick, $(date -u '+%F %T') UTC, budget $QBUDGET s" | tee -a "$LOG"

  # 1. The environment, in one line.
  qstep env 60 "$PY" -m scripts.tools._gpu_summary env --json "$QWORK/env.json"
  "$PY" -m scripts.tools._gpu_summary get "$QWORK/env.json" nccl_multi_rank >/dev/null 2>&1 && nccl=1

  # 2. The CUDA flavour, every core compiling, for the GPU present only.
  local arch cores
  cores=$(nproc)
  arch=${TORCH_CUDA_ARCH_LIST:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader \
    | sort -u | paste -sd ';')}
  QNOTE="MAX_JOBS=$cores TORCH_CUDA_ARCH_LIST=$arch CXX=${CXX:-c++}"
  if qrun build "$(qlimit 240 160)" env RINGREDUCE_CUDA=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 \
      TORCH_CUDA_ARCH_LIST="$arch" "$PY" -m scripts.tools.build_ext --jobs "$cores" --log "$build_log"
  then
    # shellcheck disable=SC2016  # expanded by the inner bash
    qstep build_check 60 bash -c '"$0" -c "from torch_ringreduce import _C; assert _C.with_cuda, \"not a CUDA build\"; print(\"_C: CUDA build\")" &&
      { readelf -d torch_ringreduce/_C*.so | grep -q "NEEDED.*libstdc++" || { echo "torch_ringreduce/_C: libstdc++ is linked statically (compiler $CXX): it crashes at run time; set RINGREDUCE_CXX to the system g++"; exit 1; }; }' "$PY" \
      && built=1
  elif [ -f "$build_log" ]; then  # build_ext.py prints the errors, but not when stopped
    echo "=== build log, last lines:" | tee -a "$LOG"
    tail -n 40 "$build_log" | tee -a "$LOG"
  fi
  if [ "$built" = 1 ]; then
    "$PY" -m scripts.tools._gpu_summary device-path --var "$DEVICE_VAR" \
      --json "$QWORK/device_path.json" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] && known=1
  fi

  # 3. Every `cuda` test twice: the default data path (host staging), then with
  #    the device path asked for. Each pass gets half of what the benchmark leaves
  #    (and the 15 s a stopped pass may take to end); the second also what the
  #    first did not use.
  local bench_reserve=$((55 + 30 * nccl + 30 * known + 10)) files pytest_args limit
  mapfile -t files < <(grep -lE 'mark\.cuda\b' tests/test_*.py)
  pytest_args=(-m pytest -v -m cuda -rfEs -p no:cacheprovider "${files[@]}")
  if [ "$built" = 1 ]; then
    limit=$((($(qleft) - bench_reserve - 15) / 2))
    qrun tests_staging "$((limit < 300 ? limit : 300))" env -u "$DEVICE_VAR" "$PY" \
      "${pytest_args[@]}" --basetemp "$QWORK/tmp_staging" --junitxml "$junit_s" \
      -o junit_suite_name=cuda_staging
    QNOTE="$DEVICE_VAR=device"
    qrun tests_device "$(qlimit 300 $((bench_reserve + 15)))" env "$DEVICE_VAR=device" "$PY" \
      "${pytest_args[@]}" --basetemp "$QWORK/tmp_device" --junitxml "$junit_d" \
      -o junit_suite_name=cuda_device
  else
    qskip tests_staging skip "no CUDA build"
    qskip tests_device skip "no CUDA build"
  fi

  # 4. The all-reduce on 2 ranks sharing the GPU: ringreduce against gloo and nccl.
  local notes=() benches=() max=256M bench_args
  [ "$(qleft)" -ge $((bench_reserve + 30)) ] || max=64M  # 256 MiB: about 10 s more
  [ "$max" = 256M ] || notes+=(--note "256 MiB left out: too little time left")
  bench_args=(-m torch_ringreduce.bench --device cuda --nproc 2 --ops allreduce -b 4K
    -e "$max" -f 4 --repeats 3 --target-time 0.2 --timeout 60)
  if [ "$built" = 1 ]; then
    benches+=(--bench staging "$QWORK/bench_staging.json")
    qrun bench_staging "$(qlimit 120 $((30 * nccl + 30 * known + 10)))" env -u "$DEVICE_VAR" \
      "$PY" "${bench_args[@]}" --backends ringreduce gloo --json "$QWORK/bench_staging.json"
  else
    qskip bench_staging skip "no CUDA build"
  fi
  if [ "$nccl" = 0 ]; then
    why=$("$PY" -m scripts.tools._gpu_summary get "$QWORK/env.json" nccl_note 2>/dev/null)
    qskip bench_nccl skip "${why:-no NCCL version}"
    notes+=(--note "nccl: ${why:-no NCCL version}")
  else
    benches+=(--bench nccl "$QWORK/bench_nccl.json")
    QNOTE="NCCL_MULTI_RANK_GPU_ENABLE=1"
    qrun bench_nccl "$(qlimit 90 $((30 * known + 10)))" env NCCL_MULTI_RANK_GPU_ENABLE=1 \
      "$PY" "${bench_args[@]}" --backends nccl --json "$QWORK/bench_nccl.json"
  fi
  if [ "$known" = 1 ]; then
    benches+=(--bench device "$QWORK/bench_device.json")
    QNOTE="$DEVICE_VAR=device"
    qrun bench_device "$(qlimit 90 10)" env "$DEVICE_VAR=device" \
      "$PY" "${bench_args[@]}" --backends ringreduce --json "$QWORK/bench_device.json"
  elif [ "$built" = 1 ]; then
    qskip bench_device skip "device path not built"
    notes+=(--note "ringreduce (device): device path not built ($DEVICE_VAR unknown to this build)")
  else
    qskip bench_device skip "no CUDA build"
  fi

  # 5. The summary: stdout, summary.txt and summary.json.
  echo "=== summary" | tee -a "$LOG"
  "$PY" -m scripts.tools._gpu_summary summarize --out-dir "$OUT_DIR" --steps "$QWORK/steps.tsv" \
    --env "$QWORK/env.json" --device-path "$QWORK/device_path.json" \
    --pass staging "$junit_s" "$QWORK/tests_staging.log" \
    --pass device "$junit_d" "$QWORK/tests_device.log" \
    "${benches[@]}" "${notes[@]}" --sizes "${QUICK_SIZES[@]}" --build-log "$build_log" \
    --budget "$QBUDGET" --total $((SECONDS - QT0)) 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "gpu_check quick: exit $rc after $((SECONDS - QT0)) s (log: $LOG)" | tee -a "$LOG"
  exit "$rc"
}
[ "${1:-}" = quick ] && { shift; quick "$@"; }
: >> "$LOG"

want env && {
  step nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  step "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
}
step "$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU'" || exit 1

# shellcheck disable=SC2016  # expanded by the inner bash
want env && step bash -c 'echo "CXX=${CXX:-} $(command -v c++ g++ | tr "\n" " ")"; ${CXX:-c++} --version | head -1'
step env RINGREDUCE_CUDA=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS="$(nproc)" \
  "$PY" setup.py -q build_ext --inplace || exit 1
step "$PY" -c "from torch_ringreduce import _C; from torch_ringreduce.sync_batchnorm import kernel_source; assert _C.with_cuda, 'not a CUDA build'; print(kernel_source('cuda'))" || exit 1
# The extension must use the process's one C++ runtime (see CXX above).
# shellcheck disable=SC2016  # expanded by the inner bash
step bash -c 'readelf -d torch_ringreduce/_C*.so | grep -q "NEEDED.*libstdc++" || { echo "torch_ringreduce/_C: libstdc++ is linked statically (compiler $CXX): it crashes at run time; set RINGREDUCE_CXX to the system g++"; exit 1; }' || exit 1

want tests && step "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider \
  tests/test_cuda_collectives.py tests/test_sync_batchnorm.py tests/test_traffic.py \
  tests/test_shrink.py
# The compile checks carry no `cuda` marker (CI runs them without a GPU): all of
# them, against the device's own toolkit and torch.
want tests && step "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py

want syncbn && for backend in ringreduce gloo; do
  step "$PY" -m scripts.benchmarks.bench_syncbn --device cuda --backend "$backend" --nproc 2 4 \
    --json "$OUT_DIR/bench_syncbn_cuda_$backend.json"
done

want coll && for n in 2 4; do
  step "$PY" -m torch_ringreduce.bench --device cuda --nproc "$n" --backends ringreduce gloo \
    --ops allreduce broadcast -b 4K -e 256M -f 4 --repeats 3 --target-time 0.2 \
    --json "$OUT_DIR/bench_collectives_cuda_np$n.json"
done

want train && for backend in ringreduce gloo; do
  step "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m scripts.training.ddp_cifar100 \
    --device cuda --backend "$backend" --ddp torch --sync-bn torch --synthetic \
    --train-size 20000 --val-size 2000 --epochs 2 --batch-size 64 \
    --json "$OUT_DIR/ddp_cifar100_cuda_$backend.json"
done
want train && {
  step "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m scripts.training.ddp_cifar100 \
    --device cuda --backend ringreduce --ddp ours --sync-bn ours --synthetic \
    --train-size 20000 --val-size 2000 --epochs 2 --batch-size 64 \
    --json "$OUT_DIR/ddp_cifar100_cuda_ringreduce_ours.json"
  step "$PY" -m scripts.benchmarks.demo --device cuda --nproc 2
}

want studies && {
  step "$PY" -m scripts.studies.bench_ddp_variants --nproc 2 --device cuda --preset small \
    --json "$OUT_DIR/ddp_variants_cuda.json"
  step "$PY" -m torch_ringreduce.bench --course-table --device cuda --workers 2 4 \
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
    step "$PY" -m torch_ringreduce.bench --nproc "$n" --backends $host_backends \
      --ops allreduce -b 4K -e 64M -f 4 --floor --memcpy --repeats 9 \
      --json "$OUT_DIR/bench_collectives_host_np$n.json"
  done
}
echo "gpu_check: exit $status (log: $LOG)"
exit $status
