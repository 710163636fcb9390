# syntax=docker/dockerfile:1
# Persimmon image: every service is `persimmon <command>` (ps, loader, worker, train, demo);
# the benchmarks are not in it (bench/ is not packaged: run them from a checkout).
#   docker build -t persimmon .                                   # CPU torch (default)
#   docker build -t persimmon:cu124 --build-arg TORCH_VARIANT=cu124 .   # CUDA 12.4 torch
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA variant of the PyTorch wheel index (cu121, cu124, ...)
ARG TORCH_VARIANT=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the variant's index, so the project's torch range installs nothing more
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services services
COPY clients clients
RUN pip install . && python -m compileall -q /opt/venv/lib

FROM python:${PYTHON_VERSION}-slim AS runtime
COPY --from=build /opt/venv /opt/venv
COPY deploy/ps.yaml /etc/persimmon/ps.yaml
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache
RUN useradd --uid 10001 --create-home persimmon \
    && mkdir -p /checkpoints /data \
    && chown persimmon /checkpoints /data
USER persimmon
WORKDIR /home/persimmon
# PS gRPC + admin, loader gRPC + admin, torch.distributed rendezvous
EXPOSE 50051 8081 50061 8091 29500
ENTRYPOINT ["persimmon"]
CMD ["--help"]
