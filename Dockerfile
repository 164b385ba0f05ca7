# The splitserve image: every service, run as `splitserve serve NAME ...`
# (see compose/docker-compose.yml). CPU PyTorch; for GPUs start from a CUDA
# base image and install torch from the matching index instead.
FROM python:3.11-slim

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
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

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
