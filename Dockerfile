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
# /signing, /verify and /audit: compose's key volumes mount there; an empty named volume takes the
# image directory's owner, so the jobs that make the keys run as this user, not root.
RUN pip install --no-cache-dir . && useradd --system --uid 10001 rudder \
    && mkdir -p /signing /verify /audit && chown rudder /signing /verify /audit
USER rudder
ENTRYPOINT ["rudder"]
