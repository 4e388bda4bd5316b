#!/usr/bin/env bash
# The one command to run on a lent GPU machine (the `device` tool), within its ~8 minute budget:
#   GPU tests, then every benchmark; results in benchmarks/results/ and copied to $OUT.
#
# Before the call, on the development machine (once per session):
#   echo /.device_data/ >> .git/info/exclude && mkdir -p .device_data \
#     && cp ../shared/data/cifar10-jpeg.zip .device_data/          # the CIFAR-10 accuracy run reads it
#   echo /.whl/ >> .git/info/exclude                               # packages the GPU image lacks:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     albumentations==2.0.8 albucore==0.0.24 jsonargparse==4.53.0 typeshed-client docstring-parser \
#     simsimd stringzilla pydantic pydantic-core annotated-types typing-inspection
# Then: run(command="bash benchmarks/gpu_check.sh", carry=[".device_data", ".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
python3 benchmarks/gpu_check.py "$@"
rc=$?
if [ -n "${OUT:-}" ]; then
  # at most 8 files come back: one archive with every result and log, plus the summary itself
  tar czf "$OUT/gpu_results.tgz" benchmarks/results /tmp/lcv_gpu_logs 2>/dev/null || true
  cp benchmarks/results/gpu_check-*.json "$OUT"/ 2>/dev/null || true
fi
exit $rc
