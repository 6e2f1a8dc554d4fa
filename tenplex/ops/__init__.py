"""Operations: what a cluster's own tools read (gRPC health and reflection, Prometheus metrics, JSON logs).

May import: grpc, grpc_health, grpc_reflection, prometheus_client, pythonjsonlogger, ``tenplex.devices``,
``tenplex.errors`` and the standard library. It sits beside the layers: the store server, the elastic job,
the operator and the CLI call into it; it never imports them (``health`` gets the store's root as a path,
``metrics`` gets callables).

Modules: :mod:`.health` (``grpc.health.v1`` and reflection on the store server), :mod:`.metrics`
(Prometheus metrics of the store server, ``tenplex run``'s workers and the operator, served on
``--metrics-port``), :mod:`.logs` (``--log-format json``).
"""
