# syntax=docker/dockerfile:1
# plsh-server and the plsh command-line tool in a container (deploy/README.md).
#
#   docker build -t plsh:cuda .                              CUDA 13 + cuBLAS
#   docker build -t plsh:cpu --build-arg PLSH_VARIANT=cpu .  CPU only, Debian 12
#
# The CUDA variant builds on NVIDIA's CUDA 13 devel image and runs on its
# base image plus cuBLAS. NVIDIA publishes those images on Ubuntu (and RHEL
# family), not Debian, so the CUDA variant is Ubuntu 24.04 in both stages;
# scripts/setup.sh (the README's and CI's installer) runs unchanged there:
# every package it names has the same name in Ubuntu 24.04. The CPU variant
# is Debian 12 in both stages, the distribution CI tests on. The build stage
# installs setup.sh's `build` packages only (0.9 GB): the test tools (Go,
# Prometheus, docker-compose, podman, ...) would add 1.1 GB and minutes.
# Build and runtime stage must be the same distribution release: the runtime
# installs the packages that own the libraries the binaries load, as the
# build stage found them (deploy/docker/runtime-packages.sh).
#
# Configuration is by PLSH_* environment variables (one per server flag,
# `plsh-server --help`); arguments after the image name go to plsh-server.

ARG PLSH_VARIANT=cuda
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_RELEASE=ubuntu24.04

# ---------------------------------------------------------------- build ----
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU_RELEASE} AS build-cuda
ENV BUILD_WITH_CUDA=ON

FROM debian:12 AS build-cpu
ENV BUILD_WITH_CUDA=OFF

FROM build-${PLSH_VARIANT} AS build
# sm_90: H100/H200, the project's default; e.g. "80;90" adds A100.
ARG CUDA_ARCHITECTURES=90
# Empty: all cores of the build machine.
ARG BUILD_JOBS=
WORKDIR /src
# setup.sh alone first, so that the package layer survives source edits.
COPY scripts/setup.sh scripts/setup.sh
RUN bash scripts/setup.sh build && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPLSH_BUILD_TESTS=OFF -DPLSH_WITH_CUDA=${BUILD_WITH_CUDA} \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
 && targets="plsh-server plsh" \
 && if [ "$BUILD_WITH_CUDA" = ON ]; then targets="$targets plsh_cuda"; fi \
 && cmake --build build --target $targets -j"${BUILD_JOBS:-$(nproc)}"
# /out is exactly what the runtime stage receives. A CUDA image without the
# CUDA backend would silently serve on the CPU: fail the build instead.
RUN install -d /out/bin /out/lib \
 && install -m 0755 build/bin/plsh-server build/bin/plsh /out/bin/ \
 && if [ "$BUILD_WITH_CUDA" = ON ]; then install -m 0644 build/lib/libplsh_cuda.so /out/lib/; fi \
 && bash deploy/docker/runtime-packages.sh --ship /out/lib /out/bin/* $(find /out/lib -name '*.so') \
        > /out/runtime-packages.txt \
 && echo "runtime packages:" $(cat /out/runtime-packages.txt)

# -------------------------------------------------------------- runtime ----
# base: the CUDA runtime (cudart) and NVIDIA's apt repository, which
# provides cuBLAS (libcublas-13-0, listed by runtime-packages.sh).
FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU_RELEASE} AS runtime-cuda
FROM debian:12-slim AS runtime-cpu

FROM runtime-${PLSH_VARIANT} AS runtime
ARG PLSH_VARIANT
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive xargs -a /tmp/runtime-packages.txt \
        apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --gid 10001 plsh \
 && useradd --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin plsh
# bin/ and lib/ side by side: the server looks for libplsh_cuda.so in
# ../lib beside its executable (kernels/src/registry.cpp).
COPY --from=build /out/bin/ /opt/plsh/bin/
COPY --from=build /out/lib/ /opt/plsh/lib/
ENV PATH=/opt/plsh/bin:${PATH} \
    PLSH_LISTEN=0.0.0.0:50051 \
    PLSH_METRICS_LISTEN=0.0.0.0:9464
LABEL org.opencontainers.image.title="plsh" \
      org.opencontainers.image.description="ALiBi attention via positional LSH over gRPC (${PLSH_VARIANT})"
EXPOSE 50051 9464
# A numeric user, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# plsh health exits 0 only when the server reports SERVING; the port follows
# PLSH_LISTEN (the part after its last colon).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD plsh health --deadline 3 --target "127.0.0.1:${PLSH_LISTEN##*:}" || exit 1
# The server drains in-flight requests on SIGTERM for up to
# PLSH_DRAIN_TIMEOUT seconds (30), then exits within PLSH_EXIT_TIMEOUT more
# (15) whatever is stuck: give `docker stop` longer (-t 50).
STOPSIGNAL SIGTERM
ENTRYPOINT ["plsh-server"]
