# One image for every Rudder process (control plane, router, worker, CLI).
# The wheel is built where a C compiler is (the router's request path compiled by mypyc: setup.py);
# the image that runs it has none.
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY bus ./bus
COPY controlplane ./controlplane
COPY router ./router
COPY worker ./worker
COPY cli ./cli
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
# /signing, /verify and /audit: compose's key volumes mount there; an empty named volume takes the
# image directory's owner, so the jobs that make the keys run as this user, not root.
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels && useradd --system --uid 10001 rudder \
    && mkdir -p /signing /verify /audit && chown rudder /signing /verify /audit
USER rudder
ENTRYPOINT ["rudder"]
