# asyncengine's serving image: our wheel on a CUDA runtime base, `asyncengine serve` as the entry point.
#
#   docker build -t asyncengine .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models:ro asyncengine /models/Llama-3-8B --max-model-len 8192
#
# Arguments after the image name go to `asyncengine serve` (with none it serves the small model shipped inside
# the package). The server drains in-flight requests for --shutdown-timeout seconds on SIGTERM: give
# `docker stop` at least that long (`--stop-timeout`, Docker's default is 10 s).

# ---- build: our wheel (pure Python: the Triton kernels are compiled on the GPU at run time) ----
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncengine/ asyncengine/
COPY api/ api/
COPY kernels/ kernels/
COPY plugins/ plugins/
COPY loadtest/ loadtest/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- run ----
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    PATH=/opt/asyncengine/bin:$PATH

# Ubuntu's Python (3.12 on 24.04) in a virtual environment. The distribution packages follow the base image's
# tag, which is pinned; pinning their patch versions too would only break the build at each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/asyncengine

COPY --from=build /wheels/ /tmp/wheels/
# torch first, at the version the project is tested with; then our wheel and its dependencies (pinned by it).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels

# A user of our own (not root), with a numeric id so that Kubernetes' runAsNonRoot can check it. Triton and
# torch keep their compile caches under its home.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin asyncengine
USER 10001
WORKDIR /home/asyncengine

EXPOSE 8000
# /health answers 200 while the engine serves, 503 once it died or while shutting down. The start period covers
# loading the weights and capturing CUDA graphs. The check asks the default port: keep --port 8000 in here.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["asyncengine", "serve"]
CMD []
