"""The one NATS adapter of Rudder (DESIGN §8, §9), used by the control plane, routers, workers
and the CLI: connecting (:mod:`bus.connect`), identities and their permissions
(:mod:`bus.identities`, :mod:`bus.jwt`, :mod:`bus.authority`), stream settings
(:mod:`bus.streams`), TLS material (:mod:`bus.tls`) and the settings fields
(:mod:`bus.settings`). It imports ``controlplane.protocol`` and nothing else of ours.
"""
