"""Execute transfer plans across the hosts' stores: parallel pulls, local copies, all-or-nothing commit.

May import: ``tenplex.store``, ``tenplex.transfer_plan``, ``tenplex.layout``, ``tenplex.box``,
``tenplex.devices``, ``tenplex.errors``, numpy and the standard library. Never torch.

    report = transform(plan, old_layout, new_layout, stores={"h0": "127.0.0.1:5001", ...},
                       old_version=3, new_version=4, progress=lambda host, done, total: ...)

Each destination host's store runs its part (``host.run_host_part``, behind the
``Transform`` RPC); ``coordinator.transform`` drives the two-phase commit and
raises :class:`~tenplex.errors.TransformError` (``.failures``: host -> cause).
Both speak plain frozen values, :class:`TransformRequest` and
:class:`TransformProgress` (defined beside the RPC, in
``tenplex.store.transformer``, since the store sits below this layer); only
the store's gRPC adapter (``tenplex.store.wire``) converts them to and from
protobuf.
"""

from ..errors import TransformError
from ..store.transformer import TransformProgress, TransformRequest
from .coordinator import transform

__all__ = ["transform", "TransformError", "TransformRequest", "TransformProgress"]
