# syntax=docker/dockerfile:1
#
# vLLM with the tokcache plugin (`--tokenizer-mode tokcache`). Build from the repository root:
#
#   docker build -f deploy/vllm.Dockerfile -t REGISTRY/vllm-tokcache:0.34.0-tokcache0.1.0 \
#       --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.34.0 .
#
# This is `pip install 'tokcache[vllm]'` from this checkout: tokcache is not published on PyPI,
# so installing it by name from an index would fetch nothing (or somebody else's package).
# The `vllm` extra is already satisfied by the base image; pip only adds tokcache's client
# dependencies. Pin VLLM_IMAGE to a verified vLLM (docs/vllm.md, "Versions"); on another one
# the plugin checks its hook points at start and says whether it runs.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.34.0
FROM ${VLLM_IMAGE}

# tokcache's C extensions are compiled by pip (setup.py): a C compiler and OpenSSL's headers
# (the image's Python headers are there already: Triton compiles against them).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*

COPY . /tmp/tokcache-src
RUN python3 -m pip install --no-cache-dir "/tmp/tokcache-src[vllm]" \
 && rm -rf /tmp/tokcache-src \
 && python3 -c "import sidecar_client._local, tokcache.engine.lookup"

# The pod runs vLLM as uid 10001, the sidecar's uid (deploy/base/deployment.yaml explains why).
# A passwd entry keeps getpass.getuser() (torch's compile caches) working for that uid.
RUN (getent group 10001 || groupadd --gid 10001 tokcache) \
 && (getent passwd 10001 || useradd --uid 10001 --gid 10001 --home-dir /home/vllm --create-home \
        --shell /usr/sbin/nologin vllm)

LABEL org.opencontainers.image.title="vllm-tokcache" \
      org.opencontainers.image.description="vLLM with the tokcache tokenizer plugin"
