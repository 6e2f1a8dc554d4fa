"""Non-tensor training state as JSON: RNG states, LR scheduler, gradient scaler, optimizer hyper-parameters.

May import: ``tenplex.errors``, torch, numpy and the standard library. No I/O.

Nothing here is pickled. Byte states (torch's RNG) are base64 in JSON.
What happens to each across a change of configuration is documented in the
README (``## Saving and restoring PyTorch state``) and in
:mod:`tenplex.integration.checkpointer`.
"""

from __future__ import annotations

import base64
import random
import zlib
from typing import Any

import numpy as np
import torch

from ..errors import PermanentError


class StateMismatchError(PermanentError, ValueError):
    """The restored model, optimizer or other state does not match what was saved."""


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict:
    """Python, numpy, torch CPU and (if initialised) CUDA generator states of this process."""
    return rng_doc(rng_state())


def rng_state() -> tuple:
    """The generator states as the libraries give them (copies): read at a step boundary, made JSON later
    (:func:`rng_doc`, a snapshot's writer thread)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def rng_doc(state: tuple) -> dict:
    """:func:`capture_rng`'s document of :func:`rng_state`'s states."""
    (version, streams, gauss), (kind, keys, pos, has_gauss, cached), cpu, cuda = state
    doc = {"python": [version, list(streams), gauss],
           "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(cpu)}
    if cuda is not None:
        doc["cuda"] = _b64(cuda)
    return doc


def apply_rng(doc: dict) -> None:
    version, state, gauss = doc["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = doc["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(doc["torch"]))
    if "cuda" in doc and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(doc["cuda"]))


def seed_rng(seed: int) -> None:
    """Seed every generator of this process from one integer (a coordinate that did not exist before)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def derived_seed(base: int, coord: str) -> int:
    """A stable seed for a new coordinate: crc32 of the coordinate mixed with the saved base seed."""
    return (base * 1_000_003 + zlib.crc32(coord.encode())) % 2**63


def to_json(value: Any, what: str) -> Any:
    """``value`` if it is JSON (tensors become lists); otherwise an error saying what cannot be saved."""
    def convert(v):
        if isinstance(v, torch.Tensor):
            return {"__tensor__": v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
        if isinstance(v, dict):
            return {str(k): convert(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [convert(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise StateMismatchError(f"{what} holds a {type(v).__name__} ({str(v)[:60]}), which tenplex cannot store "
                                 f"as JSON; keep only numbers, strings, lists, dicts and tensors in it")
    return convert(value)  # only str keys, numbers, strings, None, lists and dicts: json.dumps takes it


def from_json(doc: Any) -> Any:
    if isinstance(doc, dict):
        if "__tensor__" in doc:
            return torch.tensor(doc["__tensor__"], dtype=getattr(torch, doc["dtype"]))
        return {k: from_json(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [from_json(v) for v in doc]
    return doc


def optimizer_doc(optimizer: torch.optim.Optimizer, param_names: list[list[str]]) -> dict:
    """The optimizer's kind and each group's hyper-parameters and parameter names."""
    groups = []
    for group, names in zip(optimizer.param_groups, param_names):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": names, "hyper": to_json(hyper, f"param group of {type(optimizer).__name__}")})
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "groups": groups}


def apply_optimizer_doc(optimizer: torch.optim.Optimizer, doc: dict, param_names: list[list[str]]) -> None:
    """Check the optimizer is of the saved kind, then restore each group's hyper-parameters (lr, betas, …)."""
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if kind != doc["class"]:
        raise StateMismatchError(f"the state was saved with optimizer {doc['class']}, but the restored job uses "
                                 f"{kind}; create the same kind of optimizer (its states differ)")
    saved = doc["groups"]
    if len(saved) != len(optimizer.param_groups):
        raise StateMismatchError(f"the saved optimizer has {len(saved)} parameter groups, the restored one "
                                 f"{len(optimizer.param_groups)}; build the same groups")
    for i, (group, names, old) in enumerate(zip(optimizer.param_groups, param_names, saved)):
        stray = sorted(set(names) - set(old["params"]))
        if stray:
            raise StateMismatchError(f"parameter group {i} of the restored optimizer holds {', '.join(stray[:5])}, "
                                     f"which the saved group {i} did not hold")
        for key, value in from_json(old["hyper"]).items():
            if key in group:
                current = group[key]
                group[key] = tuple(value) if isinstance(current, tuple) else value
