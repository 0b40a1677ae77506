#!/usr/bin/env bash
# Wheels for running plasmient-trace from a checkout on an offline GPU machine that already has
# PyTorch, numpy, pyarrow, grpcio, psutil, rich and nvidia-ml-py (a CUDA PyTorch image), as the GPU
# check needs them:
#
#   scripts/offline-wheels.sh DIR [PYTHON_VERSION]      # here, with network (default Python 3.12)
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   PYTHON=python3 bash scripts/gpu-check.sh --overhead # there
#
# cupti-python is pinned to 13.0.x, the CUPTI of CUDA 13.0 images (torch cu130); pick the line that
# matches the image's nvidia-cuda-cupti.
set -euo pipefail
dir="${1:?usage: scripts/offline-wheels.sh DIR [PYTHON_VERSION]}"
pyver="${2:-3.12}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    opentelemetry-instrumentation==0.66b2 googleapis-common-protos==1.76.0 protobuf==7.36.2 \
    'cupti-python==13.0.*' pyelftools msgspec==0.23.0 orjson==3.13.0
