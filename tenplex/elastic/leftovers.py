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

What the user's code keeps is its own: a model, an optimizer or a loss of the old
world still referenced once its world ended (a loop variable that outlives the
loop's body) holds the old ``DeviceMesh`` or DDP wrapper, and with it the old
world's process groups, their gloo threads and connections. A peer still blocked
in a collective with this rank then waits the group's whole timeout instead of
failing at once (gloo reports a closed connection only). :func:`watch_groups`
takes weak references to the world's groups before it is left, and
:func:`report_pinned` warns, once per world, naming the variables that still reach
a group (a search of the caller's frames, only when a group outlived its world).
"""

from __future__ import annotations

import gc
import logging
import sys
import types
import weakref
from typing import Any

log = logging.getLogger("tenplex.elastic.job")  # a Job's own records keep its logger's name
# Not searched for a path to a group: what every object leads to (its class, modules, functions' globals).
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType,
           types.MethodType)
_SEARCH_BUDGET = 200_000  # objects visited per variable at most: a model of a few thousand tensors is far below


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


def watch_groups() -> list[weakref.ref]:
    """Weak references to every process group of the current world; take them just before leaving it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return []
    return [weakref.ref(group) for group in list(distributed_c10d._world.pg_map)]


def report_pinned(groups: list[weakref.ref], generation: int, frame: types.FrameType | None = None) -> int:
    """How many of the left world's ``groups`` (:func:`watch_groups`) are still alive, once the world's groups
    were destroyed and the garbage collected; when any is, one warning that names the variables reaching them in
    ``frame`` and its callers (the loop over worlds; default: the caller's)."""
    alive = [group for ref in groups if (group := ref()) is not None]
    if not alive:
        return 0
    try:
        holders = _holders({id(group) for group in alive}, frame or sys._getframe(1))
    except Exception:  # noqa: BLE001 -- only the warning's detail: the change must go on whatever the frames hold
        log.debug("could not search the frames for what holds the groups", exc_info=True)
        holders = []
    held = (f"held by {', '.join(holders)}" if holders else
            "held by no variable of the loop's frames (a global, a cache, a thread, or an object stored elsewhere)")
    log.warning("world %d: %d of its %d process groups outlived it, %s: drop every reference to the old world's "
                "model, optimizer, losses and wrappers when the loop's body ends (trainer = None, del model, "
                "optimizer): until then a peer blocked in a collective with this rank waits the whole group "
                "timeout instead of failing at once", generation, len(alive), len(groups), held)
    return len(alive)


def _holders(targets: set[int], frame: types.FrameType | None) -> list[str]:
    """``name (type) in function (file:line)`` for each local variable of ``frame`` and its callers whose value
    reaches one of ``targets`` (object ids); tenplex's own frames and runpy's are skipped."""
    found = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("tenplex.") or module == "runpy"):
            where = f"{frame.f_code.co_name}() ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
            for name, value in list(frame.f_locals.items()):
                if not name.startswith("__") and _reaches(value, targets):
                    found.append(f"{name} ({type(value).__name__}) in {where}")
        frame = frame.f_back
    return found


def _reaches(root: Any, targets: set[int]) -> bool:
    """Whether ``root`` leads to an object in ``targets`` through the objects the garbage collector sees."""
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _SEARCH_BUDGET:
        obj = stack.pop()
        if id(obj) in targets:
            return True
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return False
