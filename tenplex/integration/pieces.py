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

    def read(self) -> torch.Tensor:
        """The piece's values as a contiguous CPU tensor (a copy when the tensor lives on an accelerator)."""
        region = self.local[self.local_box.slices()]
        return region.detach().to("cpu").contiguous()


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
        return [Piece(name, spec, Box(offsets, lengths), Box((0,) * len(lengths), lengths), local)]
    if annotation is not None:
        spec = TensorSpec(annotation.global_shape, dtype_name(tensor.dtype))
        return [Piece(name, spec, box, local_box, tensor)
                for box, local_box in annotation.pieces(name, tuple(tensor.shape))]
    spec = TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype))
    whole = Box.whole(spec.shape)
    return [Piece(name, spec, whole, whole, tensor)]


def model_pieces(model: torch.nn.Module, annotations: Annotations | None = None) -> list[Piece]:
    """Pieces of every parameter and persistent buffer in ``model.state_dict()``, under their bare names."""
    annotations = annotations or {}
    pieces = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        name = bare_name(model, key)
        if isinstance(tensor, torch.Tensor):
            pieces += tensor_pieces(name, tensor, annotations.get(name))
    return pieces


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


def optimizer_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     annotations: Annotations | None = None) -> list[Piece]:
    """Pieces of every optimizer state that has its parameter's shape (Adam's moments and the like)."""
    annotations = annotations or {}
    pieces = []
    for name, param in _named_params(model, optimizer):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor) and _is_like(value, param):
                # A plain state of an annotated parameter is sharded like the parameter.
                annotation = None if isinstance(value, DTensor) else annotations.get(name)
                pieces += tensor_pieces(optimizer_state_name(key, name), value, annotation)
    return pieces


def optimizer_scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, float]]:
    """{param name: {key: value}} for scalar optimizer states (Adam's ``step``), as JSON numbers."""
    result: dict[str, dict[str, float]] = {}
    for name, param in _named_params(model, optimizer):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor) and _is_like(value, param):
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise LayoutError(f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, neither "
                                      f"the parameter's shape {list(param.shape)} nor a scalar; tenplex cannot "
                                      f"place it")
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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors so that they can be filled in place.

    Adam and AdamW get their documented state directly (``step``, zeroed
    ``exp_avg`` and ``exp_avg_sq``, plus ``max_exp_avg_sq`` with amsgrad), as
    their first ``step()`` would create it, without computing an update. Any
    other optimizer steps once with zero gradients and a learning rate of zero,
    as torch.distributed.checkpoint does (neither Adam-like updates nor weight
    decay change a parameter at lr 0); gradients are cleared afterwards.
    """
    if optimizer.state:
        return
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in optimizer.param_groups:
            on_device = group.get("capturable") or group.get("fused")
            for param in group["params"]:
                state = {"step": torch.zeros((), dtype=scalar, device=param.device if on_device else "cpu"),
                         "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                optimizer.state[param] = state
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
