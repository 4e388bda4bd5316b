#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU, run every check of this project that needs a GPU, in one
# command of about 8 minutes at most:
#   1. the tests marked `gpu` (`pytest -m gpu tests`);
#   2. the benchmarks conv.py, resnet_train.py, loader.py, strategy_overhead.py, cifar10_accuracy.py and
#      airbench_reference.py (airbench's own train94 on the same JPEGs), each under its own time limit (`python benchmarks/gpu_check.py --list` shows the steps and limits).
# A step that fails or runs out of time does not stop the others; a short table is printed last.
#
# Usage, from any directory:
#   bash benchmarks/gpu_check.sh                    # all steps
#   bash benchmarks/gpu_check.sh --only tests conv  # any benchmarks/gpu_check.py options
#
# Results: each benchmark writes its JSON (GPU name, torch/triton versions, commit, date) to
# benchmarks/results/, plus a summary benchmarks/results/gpu_check-<date>.json; each step's log goes to
# /tmp/lcv_gpu_logs/. If the environment variable OUT names a folder, the results and logs are also
# packed into $OUT/gpu_results.tgz and the summary JSON is copied there.
#
# Optional inputs (both folders are in .gitignore):
#   .whl/          wheels of Python packages the GPU machine lacks; they are installed without network
#                  access into /tmp/site and put on PYTHONPATH. For example, on a machine with network:
#                    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#                      -d .whl albumentations==2.0.8 albucore==0.0.24 jsonargparse==4.53.0 typeshed-client \
#                      docstring-parser simsimd stringzilla pydantic pydantic-core annotated-types typing-inspection
#                  (match --python-version to the GPU machine's Python). airbench has no wheel on PyPI: put
#                  its sdist there too (pip download --no-deps --no-binary=:all: -d .whl airbench==0.1.8).
#   .device_data/  cifar10-jpeg.zip, a zip of CIFAR-10 JPEGs (train/<class>/*.jpg, test/<class>/*.jpg) for
#                  the accuracy step; without it the step reads ../shared/data/cifar10-jpeg.zip next to the
#                  repository (if neither exists, that step fails and the others still run).
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
