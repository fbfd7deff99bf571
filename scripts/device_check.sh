#!/usr/bin/env bash
# The one-shot GPU check: everything a person needs from a lent CUDA machine, into one folder.
#
#   scripts/device_check.sh OUT [--cpu-rehearsal] [--quick]
#
# OUT receives at most 8 files, none deeper than one folder (docs/device-check.md says what each
# holds):
#   OUT/device-check.log          everything printed, each part's start, end, exit code and time
#   OUT/device/device.md          the report's device section (CPU and CUDA side by side)
#   OUT/device/device.csv         its tables, cell for cell (column `table`)
#   OUT/device/reduction.csv      the data-parallel reduction's models and gloo measured
#   OUT/device/reduction_error.png  its figure
#   OUT/cuda-tests.xml            JUnit of every `cuda`-marked test
#   OUT/perf/README.md            the benchmark table
#   OUT/perf/results.csv          the benchmark rows
#
# Each part runs under its own time cap (timeout), the slow parts last, so that the whole run
# stays within 8 minutes on one H100 (caps 200 + 120 + 120 s, plus start-up); a part cut by its
# cap leaves what it wrote (the device section is rewritten after each of its parts) and the log
# says which part was cut. The exit code is that of the first part that failed (124: cut).
#
# --cpu-rehearsal: the same run on a machine without CUDA (CI runs it): the CUDA parts run their
# CPU path (the device section with --rehearsal, the benchmarks on the CPU) and every output says
# so. --quick: small sizes (the quick corpus, one test file, the step benchmark at tiny sizes) for
# the CI test of this script.
#
# The CUDA machine has PyTorch, numpy, mpmath, ml_dtypes and Hypothesis but no gmpy2 and no
# network. Before the run, on the development machine, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl gmpy2
# then run this script there with `.whl` carried.
set -uo pipefail

usage() {
    echo "usage: scripts/device_check.sh OUT [--cpu-rehearsal] [--quick]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
OUT="$1"
shift
rehearsal=0
quick=0
for arg in "$@"; do
    case "$arg" in
        --cpu-rehearsal) rehearsal=1 ;;
        --quick) quick=1 ;;
        *) echo "device_check.sh: unknown option '$arg'" >&2; usage ;;
    esac
done
case "$OUT" in -*) echo "device_check.sh: OUT must be a folder, not an option ('$OUT')" >&2; usage ;; esac
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.." || exit 2
PYTHON="${PYTHON:-python3}"
LOG="$OUT/device-check.log"

main() {
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci

if [ "$rehearsal" = 1 ]; then
    mode="cpu-rehearsal"
    device_args=(--device cpu --rehearsal)
    bench_device=cpu
else
    mode="cuda"
    device_args=(--device all)
    bench_device=cuda
fi
size_args=()
tests=()
bench_args=(--suite step --suite overhead --suite large --suite memory)
if [ "$quick" = 1 ]; then
    size_args=(--quick)
    tests=(tests/wacc_torch/test_cuda_hardening.py)
    bench_args=(--quick --suite step)
fi
echo "device check: mode $mode$([ "$quick" = 1 ] && echo ' (quick)'), output $OUT, $(date -u '+%Y-%m-%d %H:%M UTC')"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
if [ "$rehearsal" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "device check: torch sees no CUDA device; run with --cpu-rehearsal on a CPU machine" >&2
    return 2
fi

status=0
# part NAME CAP_S COMMAND...: run under a time cap (SIGINT first, so pytest still writes its
# JUnit; SIGKILL 15 s later), log start, end, exit code and time; keep the first failure's code.
part() {
    local name="$1" cap="$2"
    shift 2
    local started=$SECONDS
    echo "--- part $name (cap ${cap} s): $*"
    timeout -s INT -k 15 "$cap" "$@"
    local code=$?
    local took=$((SECONDS - started))
    if [ "$code" = 124 ] || [ "$code" = 137 ]; then
        echo "--- part $name: CUT at its cap of ${cap} s (exit $code); what it wrote is kept"
    else
        echo "--- part $name: exit $code after ${took} s"
    fi
    if [ "$status" = 0 ] && [ "$code" != 0 ]; then status=$code; fi
}

# 1. The report's device section (its parts in order: element-wise ops, TF32 rows, FP8,
#    reduction with gloo, the training loops; written after each).
part device 200 "$PYTHON" -m wacc report --device-only "${device_args[@]}" "${size_args[@]}" \
    --quiet --out "$OUT/device"
# 2. Every `cuda`-marked test (on a CPU they skip: the JUnit says which and why).
suite="cuda-tests"
[ "$rehearsal" = 1 ] && suite="cuda-tests (cpu rehearsal: CUDA absent, the tests skip)"
part cuda-tests 120 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -p no:randomly \
    --junitxml "$OUT/cuda-tests.xml" -o junit_suite_name="$suite" "${tests[@]}"
# 3. The benchmarks (slowest, last): the table in perf/README.md, the rows in perf/results.csv.
part benchmarks 120 "$PYTHON" -m benchmarks --device "$bench_device" "${bench_args[@]}" \
    --out "$OUT/perf"
echo "device check: done in ${SECONDS} s, exit $status ($mode)"
return "$status"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
