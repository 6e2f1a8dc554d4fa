"""The reference GPT's configuration and parallel degrees: plain values, no torch.

May import: ``tenplex.parallel``, ``tenplex.errors`` and the standard library.
Kept apart from :mod:`tenplex.models.gpt` so that processes that only
orchestrate the model (``tenplex demo``) read its defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..parallel import parse_degrees


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the reference GPT (defaults: the tiny model of the demo and the tests)."""

    vocab: int = 37
    seq: int = 8
    hidden: int = 16
    heads: int = 4
    layers: int = 4
    ffn: int = 32


@dataclass(frozen=True)
class Parallel:
    """The degrees the reference GPT's ``Trainer`` runs under (``fsdp``: FSDP2 over dp instead of all-reduce)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    microbatches: int = 2

    @classmethod
    def parse(cls, text: str) -> "Parallel":
        """``"dp=2,tp=2,pp=2"`` (add ``fsdp=1`` for FSDP2 over dp, ``microbatches=N`` for the pipeline)."""
        values = parse_degrees(text, options=("fsdp", "microbatches"))
        if values.get("microbatches") == 0:
            raise ConfigError(f"microbatches must be positive in parallel spec {text!r}")
        return cls(values["dp"], values["tp"], values["pp"], fsdp=bool(values.get("fsdp", 0)),
                   microbatches=values.get("microbatches", cls.microbatches))

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp
