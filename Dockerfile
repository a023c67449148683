# syntax=docker/dockerfile:1
# dtjob operator image: `dtjob operator` (kopf) with the [operator] extra only - no torch.
#   docker build -t dtjob/operator:0.1.0 .
# The helm chart (helm/dtjob) runs it as uid 10001 with a read-only root filesystem and an
# emptyDir at /tmp.

# Build stage: wheels for dtjob and every dependency of its [operator] extra, so the runtime
# stage needs no compiler, no build backend and no network.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/dtjob operator/dtjob
COPY trainer_image/dtjob trainer_image/dtjob
COPY devcluster/dtjob devcluster/dtjob
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:3.11.11-slim-bookworm
# uid/gid 10001: outside the range of the base image's system users; the chart's
# podSecurityContext uses the same numbers.
RUN groupadd --gid 10001 dtjob \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin dtjob
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "dtjob[operator]"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# 8080: liveness (/healthz), 9401: Prometheus metrics (/metrics); the chart's defaults.
EXPOSE 8080 9401
HEALTHCHECK --interval=30s --timeout=5s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["dtjob", "operator"]
CMD ["--all-namespaces"]
