#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU, every check of this project that needs one, in one command that
# ends within 7 minutes (benchmarks/gpu_check.py --budget; give the call 8). Set-up first, then
# gpu_check.py, which writes gpu_check.jsonl, gpu_check-summary.json and gpu_results.tgz to $OUT (or
# benchmarks/results) as it goes: a call cut short keeps what was measured.
#
#   LCV_COMMIT=<commit> bash benchmarks/gpu_check.sh              # all steps
#   LCV_COMMIT=<commit> bash benchmarks/gpu_check.sh --only correctness conv
#
# LCV_COMMIT names the commit in every result file (a lent machine's copy may have no .git, or a stale one).
# Optional inputs, both in .gitignore, to carry along:
#   .device_data/cifar10-jpeg.npz  the CIFAR-10 JPEGs for the time-to-94% step, made here by
#                  python benchmarks/device_data.py pack ../shared/data/cifar10-jpeg.zip .device_data/cifar10-jpeg.npz
#                  (17.7 MiB; the zip itself is 59.3 MiB). Without it that step is skipped with the reason.
#   .whl/          wheels of packages the GPU machine lacks (albumentations for the loader's reference side,
#                  airbench's sdist for the airbench reference step), installed offline into /tmp/site.
#                  docs/benchmarks.md ("GPU check") gives the download command.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if compgen -G ".whl/*.tar.gz" > /dev/null; then  # pure-Python sdists (airbench)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .whl/*.tar.gz \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if [ -f .device_data/cifar10-jpeg.npz ]; then
  python3 benchmarks/device_data.py unpack .device_data/cifar10-jpeg.npz /tmp/lcv-device-data/cifar10-jpeg.zip
fi
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/vision:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
exec python3 benchmarks/gpu_check.py "$@"
