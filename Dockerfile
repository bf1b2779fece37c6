# One image for every Rudder process (control plane, router, worker, CLI).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY controlplane ./controlplane
COPY router ./router
COPY worker ./worker
COPY cli ./cli
COPY migrations ./migrations
RUN pip install --no-cache-dir . && useradd --system --uid 10001 rudder
USER rudder
ENTRYPOINT ["rudder"]
