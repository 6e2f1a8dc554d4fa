"""What one world leaves in process-wide state that the next world of the same process must not inherit.

May import: torch and the standard library.

Measured with torch 2.13 (CPU, gloo), a process that lives through several worlds
(:mod:`tenplex.elastic.worlds`):

* DTensor caches each operator's sharding propagation under a key that holds the
  ``DeviceMesh``, and two meshes compare equal when their shape, names and device
  type do, whatever their process groups and this rank's place in them. A model
  rebuilt with the same tp on a new mesh where this process has another tp rank
  (tp=2 -> tp=1 -> tp=2, the joiner taking rank 0) got the old rank's local shapes
  from the cache: the head's ``view`` failed on the uneven vocabulary shard. The
  redistribution planners' cache (keyed by a weak reference to the mesh, but each
  planner holds its mesh) and the mesh topologies' cache kept every mesh, and with
  it the old world's groups, their gloo threads and sockets, for the rest of the
  process. :func:`forget_world` clears these caches when a world ends.
"""

from __future__ import annotations

import sys


def forget_world() -> None:
    """Clear DTensor's caches keyed by the ended world's meshes (see the module docstring)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was used: nothing cached
        return
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()            # the Python cache
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()      # the C++ fast path's
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()         # its planners hold their meshes strongly
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
