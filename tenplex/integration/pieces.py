"""Framework state -> named global tensors with boxes ("pieces").

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.gpt`` (names), ``tenplex.errors``,
``tenplex.integration.annotate``, torch and the standard library. No I/O.

A :class:`Piece` ties one box of one named global tensor to the region of a
local ``torch.Tensor`` that holds it. Saving copies each piece's local region
out; restoring copies into it, in place, on the tensor's own device.

Where the box comes from:

* a DTensor (``parallelize_module`` tensor parallelism, FSDP2 ``fully_shard``,
  uneven shards included): PyTorch's own
  ``compute_local_shape_and_global_offset`` from its mesh and placements, as
  torch.distributed.checkpoint does;
* a plain tensor with an annotation (Megatron-style shards, maybe padded):
  the annotation (:mod:`tenplex.integration.annotate`);
* any other plain tensor: the whole tensor, a replica (data parallelism, or
  a pipeline stage that owns the parameter under its global name).

Tensor names: a parameter or buffer keeps its state-dict name (``layers.0.attn.qkv.weight``), without the
prefixes of DDP, torch.compile and checkpoint_wrapper (:mod:`.names`);
its optimizer states are ``optim.exp_avg.NAME``, ``optim.exp_avg_sq.NAME`` and so
on (:func:`tenplex.gpt.optimizer_state_name`, the same names as the PTC core's
rules). Scalar optimizer states such as Adam's ``step`` are not tensors of the collection; they travel as JSON
(:func:`optimizer_scalars`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..box import Box
from ..errors import LayoutError
from ..gpt import optimizer_state_name
from ..layout import TensorSpec
from .annotate import Annotations
from .names import bare_name, parameter_names


@dataclass(frozen=True)
class Piece:
    name: str
    spec: TensorSpec
    box: Box          # in global coordinates
    local_box: Box    # the same region inside ``local``
    local: torch.Tensor
    # The in-place version counters when the piece was made (None: not tracked, an inference tensor): snapshots
    # skip a piece whose counters and storage did not change since the last one (:mod:`.snapshot`)
    version: tuple[int, ...] | None = None

    def read(self) -> torch.Tensor:
        """The piece's values as a contiguous CPU tensor (a copy when the tensor lives on an accelerator)."""
        region = self.local[self.local_box.slices()]
        return region.detach().to("cpu").contiguous()


_VERSION = operator.attrgetter("_version")


def version_of(*tensors: torch.Tensor) -> tuple[int, ...] | None:
    """The tensors' in-place version counters. A DTensor's in-place ops bump the wrapper's counter, not its
    local tensor's (measured, torch 2.13), and a copy into the local tensor bumps only the local one: both count."""
    try:
        return tuple(map(_VERSION, tensors))  # read by C: ~0.2 us less per piece and step than a generator
    except RuntimeError:  # inference tensors track no version
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


OPTIMIZER_PREFIX = optimizer_state_name("STATE", "P").split("STATE")[0]  # "optim.": starts every optimizer tensor


def tensor_pieces(name: str, tensor: torch.Tensor, annotation=None) -> list[Piece]:
    """The pieces of one (maybe distributed, maybe annotated) tensor held by this rank."""
    if isinstance(tensor, DTensor):
        if annotation is not None:
            raise LayoutError(f"tensor {name!r} is a DTensor, which carries its own mesh and placements; "
                              f"remove its annotation")
        global_shape = tuple(tensor.shape)
        with torch.no_grad():  # the local tensor itself, not an autograd alias that in-place copies would break
            local = tensor.to_local()
        local_shape, offsets = compute_local_shape_and_global_offset(global_shape, tensor.device_mesh,
                                                                     tensor.placements)
        spec = TensorSpec(global_shape, dtype_name(tensor.dtype))
        lengths = tuple(local_shape)
        if any(n > m for n, m in zip(lengths, local.shape)):
            raise LayoutError(f"tensor {name!r}: local tensor of shape {list(local.shape)} is smaller than its "
                              f"shard {list(lengths)} computed from mesh {tensor.device_mesh} and placements "
                              f"{tensor.placements}")
        return [Piece(name, spec, Box(offsets, lengths), Box((0,) * len(lengths), lengths), local,
                      version_of(tensor, local))]
    if annotation is not None:
        spec = TensorSpec(annotation.global_shape, dtype_name(tensor.dtype))
        return [Piece(name, spec, box, local_box, tensor, version_of(tensor))
                for box, local_box in annotation.pieces(name, tuple(tensor.shape))]
    spec = TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype))
    whole = Box.whole(spec.shape)
    return [Piece(name, spec, whole, whole, tensor, version_of(tensor))]


def model_pieces(model: torch.nn.Module, annotations: Annotations | None = None) -> list[Piece]:
    """Pieces of every parameter and persistent buffer in ``model.state_dict()``, under their bare names."""
    annotations = annotations or {}
    pieces = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        name = bare_name(model, key)
        if isinstance(tensor, torch.Tensor):
            pieces += tensor_pieces(name, tensor, annotations.get(name))
    return pieces


def buffer_names(model: torch.nn.Module) -> list[str]:
    """Bare names of the model's persistent buffers: the state-dict tensors that are not parameters."""
    return sorted(bare_name(model, key) for key, tensor in model.state_dict(keep_vars=True).items()
                  if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter))


def _named_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    names = parameter_names(model)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise LayoutError(f"the optimizer holds a parameter of shape {list(param.shape)} that the model "
                                  f"does not have; pass the model whose parameters the optimizer updates")
            yield names[id(param)], param


def _is_like(state: torch.Tensor, param: torch.Tensor) -> bool:
    return state.dim() > 0 and tuple(state.shape) == tuple(param.shape)


def _reduced_dims(state: torch.Tensor, param: torch.Tensor) -> list[int] | None:
    """The dimensions a factored moment averages away (Adafactor's ``row_var`` [R, 1] and ``col_var`` [1, C]
    of a [R, C] parameter): the state keeps every other dimension of the parameter at its length. None when
    ``state`` is not such a moment."""
    if state.dim() == 0 or state.dim() != param.dim():
        return None
    if any(n not in (1, m) for n, m in zip(state.shape, param.shape)):
        return None
    reduced = [d for d, (n, m) in enumerate(zip(state.shape, param.shape)) if n == 1 and m != 1]
    return reduced or None


def _saved_as_tensor(value, param: torch.Tensor) -> bool:
    """Whether an optimizer state is a tensor of the collection (else a scalar that travels as JSON)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if isinstance(value, DTensor):
        return True
    return _is_like(value, param) or _reduced_dims(value, param) is not None or value.numel() != 1


def _factored_pieces(name: str, state: torch.Tensor, reduced: list[int], param_pieces: list[Piece],
                     where: str) -> list[Piece]:
    """A factored moment is split like its parameter along the dimensions it keeps; along those it averages
    away, the rank must hold the whole parameter (else its moment is a statistic of its part alone)."""
    pieces = []
    for pp in param_pieces:
        split = [d for d in reduced if pp.box.lengths[d] != pp.spec.shape[d]]
        if split:
            raise LayoutError(f"{where} is averaged over dimension {split[0]} of the parameter, which this rank "
                              f"holds only in part ({pp.box} of {list(pp.spec.shape)}): its values are not the "
                              f"whole parameter's and tenplex cannot place them; hold that dimension whole")

        def collapse(box: Box) -> Box:
            return Box(tuple(0 if d in reduced else o for d, o in enumerate(box.offsets)),
                       tuple(1 if d in reduced else n for d, n in enumerate(box.lengths)))
        shape = tuple(1 if d in reduced else n for d, n in enumerate(pp.spec.shape))
        pieces.append(Piece(name, TensorSpec(shape, dtype_name(state.dtype)), collapse(pp.box),
                            collapse(pp.local_box), state, version_of(state)))
    return pieces


def _holds_whole(param_pieces: list[Piece]) -> bool:
    return len(param_pieces) == 1 and param_pieces[0].box == Box.whole(param_pieces[0].spec.shape)


def optimizer_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     annotations: Annotations | None = None) -> list[Piece]:
    """Pieces of every optimizer state tensor that is not a scalar.

    A state shaped like its parameter (Adam's moments) is split like the parameter; a DTensor state
    carries its own placements; a factored moment (Adafactor's ``row_var``/``col_var``) is split like the
    parameter along the dimensions it keeps; any other state is saved whole, and only by ranks that hold
    the whole parameter (a replica), since tenplex cannot know how to split it.
    """
    annotations = annotations or {}
    kind = type(optimizer).__name__
    pieces = []
    for name, param in _named_params(model, optimizer):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not _saved_as_tensor(value, param):
                continue
            state_name = optimizer_state_name(key, name)
            where = f"{kind}'s state {key!r} of {name!r} (shape {list(value.shape)})"
            if isinstance(value, DTensor):
                if any(p.is_partial() for p in value.placements):
                    raise LayoutError(f"{where} is a partial sum over its mesh ({value.placements}); tenplex "
                                      f"saves only shards and replicas")
                pieces += tensor_pieces(state_name, value)
                continue
            # A plain state of an annotated parameter is sharded like the parameter.
            annotation = annotations.get(name)
            if _is_like(value, param):
                pieces += tensor_pieces(state_name, value, annotation)
                continue
            param_pieces = tensor_pieces(name, param, None if isinstance(param, DTensor) else annotation)
            reduced = _reduced_dims(value, param)
            if reduced is not None and not isinstance(param, DTensor):
                pieces += _factored_pieces(state_name, value, reduced, param_pieces, where)
            elif _holds_whole(param_pieces):
                pieces += tensor_pieces(state_name, value)
            else:
                raise LayoutError(f"{where} is neither shaped like its parameter {list(param.shape)} nor a factored "
                                  f"moment of it, so tenplex saves and restores it only whole, on ranks that hold the "
                                  f"whole parameter; this rank holds {param_pieces[0].box} of "
                                  f"{list(param_pieces[0].spec.shape)}")
    return pieces


def named_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(bare name, parameter) of every parameter the optimizer holds, in its groups' order."""
    return list(_named_params(model, optimizer))


def optimizer_scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      named: list[tuple[str, torch.Tensor]] | None = None) -> dict[str, dict[str, float]]:
    """{param name: {key: value}} for scalar optimizer states (Adam's ``step``), as JSON numbers. ``named``:
    :func:`named_optimizer_params`, when the caller knows it unchanged (walking the model costs more than the rest)."""
    result: dict[str, dict[str, float]] = {}
    for name, param in (_named_params(model, optimizer) if named is None else named):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if _saved_as_tensor(value, param):
                continue
            if isinstance(value, torch.Tensor):
                value = value.item()
            if not isinstance(value, (int, float, bool)):
                raise LayoutError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; only tensors "
                                  f"and numbers can be saved")
            result.setdefault(name, {})[key] = value
    return result


def set_optimizer_scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          scalars: dict[str, dict[str, float]]) -> None:
    """Write scalar states back, keeping each one's tensor type and device."""
    for name, param in _named_params(model, optimizer):
        state = optimizer.state.get(param, {})
        for key, value in scalars.get(name, {}).items():
            old = state.get(key)
            if isinstance(old, torch.Tensor):
                with torch.no_grad():
                    old.fill_(value)
            else:
                state[key] = value


def init_optimizer_state(optimizer: torch.optim.Optimizer, only: set[str] | None = None,
                         model: torch.nn.Module | None = None) -> None:
    """Create the optimizer's state tensors so that they can be filled in place.

    ``only`` (with ``model``, whose parameter names it holds): the parameters whose state was saved; the
    others are left without state, as torch leaves a frozen or unused parameter (state they hold is
    dropped). None: every parameter, unless the optimizer holds some state already.

    Adam and AdamW get their documented state directly (``step``, zeroed
    ``exp_avg`` and ``exp_avg_sq``, plus ``max_exp_avg_sq`` with amsgrad), as
    their first ``step()`` would create it, without computing an update. Any
    other optimizer steps once with zero gradients (only where state is wanted)
    and a learning rate of zero, as torch.distributed.checkpoint does (neither
    Adam-like updates nor weight decay change a parameter at lr 0); every
    gradient is put back afterwards.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if only is None:
        if optimizer.state:
            return
        wanted = {id(p) for p in params}
    else:
        assert model is not None, "init_optimizer_state(only=...) needs the model that names the parameters"
        wanted = {id(p) for name, p in _named_params(model, optimizer) if name in only}
        for param in [p for p in optimizer.state if id(p) not in wanted]:
            del optimizer.state[param]
    missing = {id(p) for p in params if id(p) in wanted and not optimizer.state.get(p)}
    if not missing:
        return
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in optimizer.param_groups:
            on_device = group.get("capturable") or group.get("fused")
            for param in [p for p in group["params"] if id(p) in missing]:
                state = {"step": torch.zeros((), dtype=scalar, device=param.device if on_device else "cpu"),
                         "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                optimizer.state[param] = state
        return
    grads = {id(p): p.grad for p in params}
    for param in params:  # torch creates state only for parameters with a gradient
        param.grad = torch.zeros_like(param) if id(param) in missing else None
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for param in params:
        param.grad = grads[id(param)]


def state_owners(tensor_names, scalars: dict) -> set[str]:
    """Names of the parameters whose optimizer state was saved: those of its tensors (``optim.KEY.NAME``,
    optimizer state keys have no dots) and of its scalars."""
    owners = set(scalars)
    for tensor in tensor_names:
        if tensor.startswith(OPTIMIZER_PREFIX):
            owners.add(tensor[len(OPTIMIZER_PREFIX):].partition(".")[2])
    return owners
