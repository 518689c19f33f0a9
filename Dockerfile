# syntax=docker/dockerfile:1
# One image for `retrywatch proxy`, `retrywatch detect` and `retrywatch dashboard` (and the rest of
# the command line): the entrypoint is `retrywatch`, the container's arguments pick the command.
#
#   docker build -t retrywatch:0.1.0 .
#   docker run --rm -p 127.0.0.1:8100:8100 retrywatch:0.1.0 proxy --upstream http://HOST:8000 --host 0.0.0.0
#
# deploy/kubernetes names it `retrywatch` (kustomize `images:` sets your registry and tag).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1 UV_COMPILE_BYTECODE=1
RUN pip install uv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY foundation foundation
COPY exporter exporter
COPY detector detector
COPY rules rules
COPY dashboard dashboard
COPY reproduce reproduce
COPY retrywatch retrywatch
# A virtual environment under /opt/retrywatch holds the project and its dependencies, nothing else.
RUN uv venv /opt/retrywatch && uv pip install --python /opt/retrywatch/bin/python .

FROM ${PYTHON_IMAGE}
# The same base as the build stage: the environment's python is the base image's.
COPY --from=build /opt/retrywatch /opt/retrywatch
ENV PATH=/opt/retrywatch/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin retrywatch
# Non-root, numeric so that Kubernetes' runAsNonRoot can check it; the root file system can be
# read-only (the processes write nothing but the detector's SQLite file, on a volume).
USER 10001:10001
# proxy, detector, dashboard (each listens on 127.0.0.1 unless given --host)
EXPOSE 8100 8200 8050
ENTRYPOINT ["retrywatch"]
CMD ["--help"]
