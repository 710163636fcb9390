#!/usr/bin/env bash
# Build compose.local.yaml's images with podman where no image registry can be reached:
# a Debian base made by debootstrap from Debian's package registry, Python, Redis and
# Prometheus from Debian's packages, and the project's Dockerfile on that base with torch's
# CPU wheel as this machine's pip finds it (never the multi-GB CUDA wheel).
#
#   deploy/local/build-images.sh     # as root; needs podman, runc and debootstrap
#
# Images: localhost/persimmon-debian:bookworm (made once: remove it to remake it),
# localhost/persimmon-python:bookworm, localhost/persimmon:local,
# localhost/persimmon-redis:local, localhost/persimmon-prometheus:local. Later runs reuse
# podman's layer cache. Where pip has no local torch CPU wheel, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN=localhost/persimmon-debian:bookworm

step() { printf '== %s (%ss)\n' "$1" "$SECONDS"; }
# crun refuses hybrid cgroups; podman's default ulimits fail with "setrlimit: Operation not permitted"
build() { podman build --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
              --layers --build-arg "DEBIAN=$DEBIAN" "$@"; }

if ! podman image exists "$DEBIAN"; then
    step "debootstrap --variant=minbase bookworm"
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >/dev/null
    printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"  # no daemons start at install
    chmod +x "$rootfs/usr/sbin/policy-rc.d"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$DEBIAN" >/dev/null
fi

step "torch $TORCH_VERSION+cpu wheel into deploy/wheels (git-ignored)"
find deploy/wheels -name 'torch-*.whl' ! -name "torch-$TORCH_VERSION+cpu-*" -delete
if ! ls deploy/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --dest deploy/wheels "torch==$TORCH_VERSION+cpu"
fi

# pip in the build trusts what pip here trusts (a TLS-intercepting proxy's CA), as a build secret
cert="${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}"
secret=()
if [ -n "$cert" ]; then secret=(--secret "id=pip_cert,src=$cert"); fi

step "python base";  build -t localhost/persimmon-python:bookworm -f deploy/local/python.Containerfile deploy/local
step "persimmon"
old="$(podman image inspect --format '{{.Id}}' localhost/persimmon:local 2>/dev/null || true)"
build -t localhost/persimmon:local "${secret[@]}" --build-arg BASE=localhost/persimmon-python:bookworm .
# the image this one replaced (its own project layer on the shared venv): remove it unless in use
if [ -n "$old" ] && [ "$old" != "$(podman image inspect --format '{{.Id}}' localhost/persimmon:local)" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true
fi
step "redis";        build -t localhost/persimmon-redis:local -f deploy/local/redis.Containerfile deploy/local
step "prometheus";   build -t localhost/persimmon-prometheus:local -f deploy/local/prometheus.Containerfile deploy/local
step "images built"
