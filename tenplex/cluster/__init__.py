"""The emulated cluster: simulated hosts on one machine, each with a network link of its own.

May import: ``tenplex.errors`` and the standard library. Used by the elastic runtime (``tenplex demo --elastic
--link-mbit``) and by the benchmarks; it imports neither.
"""

from .emulated import (CONTROL, HOST_DEVICE, ClusterError, ClusterUnavailable, Counters, EmulatedCluster, LinkBytes,
                       unavailable)

__all__ = ["CONTROL", "HOST_DEVICE", "ClusterError", "ClusterUnavailable", "Counters", "EmulatedCluster",
           "LinkBytes", "unavailable"]
