# The splitserve image: every service, run as `splitserve serve NAME ...`
# (see compose/docker-compose.yml). Two builds of it, by which PyTorch it holds:
#   docker build -t splitserve:latest .                        # CPU PyTorch (the default)
#   docker build --build-arg TORCH=cuda -t splitserve:cuda .   # CUDA PyTorch, for GPU model workers
# The CUDA build runs on any host whose NVIDIA driver supports its CUDA
# version: PyTorch's CUDA libraries come with it as pip packages, the driver
# from the host (NVIDIA Container Toolkit; compose/docker-compose.gpu.yml and
# deploy/k8s/gpu ask for the GPUs).
ARG TORCH=cpu

FROM python:3.11-slim AS system

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITSERVE_CACHE_DIR=/opt/splitserve/cache \
    HF_HOME=/tmp/huggingface

# A C compiler: the engine compiles its CPU kernels (shared/engine/kernels) for the CPU it runs on.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Torch first, in its own layer: it is by far the largest and changes least.
FROM system AS torch-cpu
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# PyPI's Linux wheel of torch is its CUDA build.
FROM system AS torch-cuda
RUN pip install torch==2.13.0

FROM torch-${TORCH}

# The project, then the built-in random model built once into the image
# (`--model splitserve-default-llama`, what compose/ runs, so containers start
# at once and offline), then an unprivileged user to run as, owning /data (a
# named volume mounted there, e.g. the kv-store's disk tier, takes its owner
# from the image's directory when first created).
WORKDIR /opt/splitserve/src
COPY . .
RUN pip install . \
 && python -c "from shared.engine.default_model import default_model_dir; print(default_model_dir())" \
 && python -c "from shared.engine.kernels import native_library; print([native_library(n) for n in ('paged_decode', 'layer_ops')])" \
 && useradd --system --uid 1000 --home-dir /opt/splitserve splitserve \
 && mkdir -p /data && chown splitserve:splitserve /data \
 && chmod -R a+rX /opt/splitserve \
 && chown -R splitserve /opt/splitserve/cache/kernels

USER splitserve
WORKDIR /opt/splitserve
EXPOSE 8000
ENTRYPOINT ["splitserve"]
CMD ["--help"]
