# syntax=docker/dockerfile:1
# Persimmon image: every service is `persimmon <command>` (ps, loader, worker, train, demo);
# the benchmarks are not in it (bench/ is not packaged: run them from a checkout).
#   docker build -t persimmon .                                   # CPU torch (default)
#   docker build -t persimmon:cu124 --build-arg TORCH_VARIANT=cu124 .   # CUDA 12.4 torch
#   docker build -t persimmon:core --target core .   # PS shards and loaders only: no torch
# BASE: any Debian-like image whose `python` is Python 3.11+ with venv (both stages use it);
# deploy/local/build-images.sh builds one from debootstrap when no image registry is reachable.
# A torch wheel put in deploy/wheels/ (git-ignored) is installed instead of the variant's index.
ARG PYTHON_VERSION=3.11
ARG BASE=python:${PYTHON_VERSION}-slim

FROM ${BASE} AS deps-core
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# the core dependencies alone first (a layer code and README changes leave cached)
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip_cert if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    mkdir services clients && touch README.md && pip install ".[compression]" "setuptools>=68" \
    && pip uninstall -y persimmon && rm -r services clients README.md

FROM deps-core AS deps
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA variant of the PyTorch wheel index (cu121, cu124, ...)
ARG TORCH_VARIANT=cpu
# torch first, from deploy/wheels/ or the variant's index, so the train extra's range adds nothing
COPY deploy/wheels /wheels
# (a build secret pip_cert, when given, is the CA bundle pip trusts: a TLS-intercepting proxy's)
RUN --mount=type=secret,id=pip_cert if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if ls /wheels/torch-*.whl >/dev/null 2>&1; then pip install /wheels/torch-*.whl; \
    else pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"; fi
RUN --mount=type=secret,id=pip_cert if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    mkdir services clients && touch README.md && pip install ".[demo,compression]" \
    && pip uninstall -y persimmon && rm -r services clients README.md

# The final stages copy a dependencies venv (a layer that code changes leave cached), then
# install the project on it in a small layer of its own: a code change rebuilds that layer
# alone, never a copy of the whole venv (GBs with torch).
FROM ${BASE} AS runtime-base
COPY deploy/ps.yaml /etc/persimmon/ps.yaml
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --create-home persimmon \
    && mkdir -p /checkpoints /data \
    && chown persimmon /checkpoints /data
WORKDIR /home/persimmon
# PS gRPC + admin, loader gRPC + admin, torch.distributed rendezvous
EXPOSE 50051 8081 50061 8091 29500
ENTRYPOINT ["persimmon"]
CMD ["--help"]

# `--target core`: `persimmon ps` and `persimmon loader` (the core install, no torch)
FROM runtime-base AS core
COPY --from=deps-core /opt/venv /opt/venv
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY clients /src/clients
RUN pip install --no-deps --no-build-isolation /src && rm -rf /src
USER persimmon

# the default image (last stage): every command
FROM runtime-base AS runtime
COPY --from=deps /opt/venv /opt/venv
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY clients /src/clients
RUN pip install --no-deps --no-build-isolation /src && rm -rf /src
USER persimmon
