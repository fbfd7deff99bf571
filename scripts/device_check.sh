#!/usr/bin/env bash
# The GPU checks in one prepared run, for a session that is lent a CUDA machine (see README).
#
# That machine has PyTorch, numpy, mpmath, ml_dtypes and Hypothesis but no gmpy2 and no network.
# Before the run, on the development machine, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl gmpy2
# then run this script there with `.whl` carried. It prints, in order: the devices, every
# `cuda`-marked test (the judge on CUDA, the fp16 W = 70000 division, async pinned snapshots,
# resume, the NCCL/gloo reduction), then the performance suites on CUDA (`python -m benchmarks`,
# capped at 180 s; the table lands in $OUT/perf/README.md, the CSV next to it), the real layer sets
# and the decoder step on CUDA ($OUT/perf-shapes, capped at 240 s), then the older accumulate
# benchmark's CPU/CUDA ratios. About 8 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
status=0
python3 -m pytest -m cuda -q -p no:cacheprovider \
    ${OUT:+--junitxml "$OUT/cuda-tests.xml"} || status=$?
timeout 180 python3 -m benchmarks --device cuda --suite step --suite overhead --suite large \
    --suite memory --out "${OUT:-/tmp}/perf" || status=$?
# The real layer sets (GB/s against a device-to-device copy) and the 512-2048-token decoder step.
timeout 240 python3 -m benchmarks --device cuda --suite shapes --suite decoder \
    --out "${OUT:-/tmp}/perf-shapes" || status=$?
timeout 60 python3 benchmarks/bench_accumulate.py --repeats 20 || status=$?
exit "$status"
