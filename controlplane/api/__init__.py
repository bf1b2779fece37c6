"""The admin API (its own listener; the only write path for policy). One module per concern:

    app.py         assembly: the routers, the middleware, /openapi.json, the one error mapping
    deps.py        who is asking (decided once per request) and a write's body as read
    models.py      the answers, the error body, how a route describes itself
    observe.py     request ids, request and write metrics
    policy.py      /router_policy: documents, patch, history, rollback, calibration reset
    thresholds.py  /router_policy/busy_threshold (alias /busy_threshold)
    fleet.py       /routers, /workers, /routers/acks
    audit.py       /audit: records, verify, reconcile
    health.py      /healthz, /readyz, /metrics
    ui.py          /ui: the read-only web console (static files calling the JSON API)

Routes are thin: they declare who may call them and what they take and answer, and hand over to
the write path (controlplane/writepath.py) or a query. A later noun (API tokens) is one more
module with its router, added to ``app.ROUTERS``.
"""

from controlplane.api.app import build_app

__all__ = ["build_app"]
