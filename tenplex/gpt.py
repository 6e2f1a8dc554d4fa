"""Built-in partition rules for a GPT-style transformer (Megatron-style tensor parallelism).

May import: ``tenplex.ptc``, ``tenplex.errors`` and the standard library. Pure.

Tensor names follow a plain PyTorch GPT module (``h`` = hidden, ``f`` = ffn,
``V`` = vocab, ``S`` = max_seq; "tp" says how tensor parallelism splits it):

=====================================  ===========  ==========================================
name                                   shape        tensor parallelism
=====================================  ===========  ==========================================
``embed.weight``                       [V, h]       dim 0, padded to a multiple of
                                                    ``vocab_pad_multiple * tp``; first stage
                                                    (first and last when ``tied``)
``pos_embed.weight`` (if ``max_seq``)  [S, h]       replicated; first stage
``layers.{i}.ln1.weight`` / ``.bias``  [h]          replicated
``layers.{i}.attn.qkv.weight``         [3h, h]      dim 0, fused blocks q|k|v, split by heads
``layers.{i}.attn.qkv.bias``           [3h]         as the weight
``layers.{i}.attn.proj.weight``        [h, h]       dim 1, split by heads
``layers.{i}.attn.proj.bias``          [h]          replicated
``layers.{i}.ln2.weight`` / ``.bias``  [h]          replicated
``layers.{i}.mlp.fc1.weight``          [f, h]       dim 0, ``torch.chunk`` (uneven allowed);
                                                    [2f, h] fused gate|up when ``gated``
``layers.{i}.mlp.fc1.bias``            [f] / [2f]   as the weight
``layers.{i}.mlp.fc2.weight``          [h, f]       dim 1, ``torch.chunk``
``layers.{i}.mlp.fc2.bias``            [h]          replicated
``norm.weight`` / ``norm.bias``        [h]          replicated; last stage
``head.weight`` (unless ``tied``)      [V, h]       dim 0, padded like the embedding; last stage
=====================================  ===========  ==========================================

Biases exist only when ``bias`` is true. With ``optimizer="adam"`` every
parameter ``P`` has two optimizer-state tensors of the same shape and split,
``optim.exp_avg.P`` and ``optim.exp_avg_sq.P``, of ``optim_dtype``; these are
what the ``"optimizer"`` sharding mode shards over dp.
"""

from __future__ import annotations

from .errors import ConfigError
from .ptc import PTC, TensorRule

OPTIMIZERS = {None: (), "none": (), "adam": ("exp_avg", "exp_avg_sq")}


def optimizer_state_name(state: str, param: str) -> str:
    """Name of optimizer state ``state`` (e.g. ``exp_avg``) of parameter ``param``."""
    return f"optim.{state}.{param}"


def gpt(layers: int, hidden: int, heads: int, vocab: int, ffn: int | None = None, *,
        dtype: str = "float32", optimizer: str | None = None, optim_dtype: str = "float32",
        tied: bool = False, gated: bool = False, bias: bool = True, max_seq: int = 0,
        vocab_pad_multiple: int = 1) -> PTC:
    """The PTC of a GPT model with ``layers`` blocks (``ffn`` defaults to 4 * hidden)."""
    ffn = 4 * hidden if ffn is None else ffn
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab), ("ffn", ffn)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"GPT {name} must be a positive integer, got {value!r}")
    if hidden % heads:
        raise ConfigError(f"hidden {hidden} is not divisible by heads {heads}; choose heads dividing {hidden}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; supported: adam, none")
    head_dim = hidden // heads
    h, f = hidden, ffn

    def rule(name, shape, **kw) -> TensorRule:
        return TensorRule(name, shape, dtype, **kw)

    params = [rule("embed.weight", (vocab, h), tp_dim=0, split="pad", pad_multiple=vocab_pad_multiple,
                   anchors=("first", "last") if tied else ("first",))]
    if max_seq:
        params.append(rule("pos_embed.weight", (max_seq, h), anchors=("first",)))
    fc1 = (2 * f, (f, f)) if gated else (f, None)
    for i in range(layers):
        p = f"layers.{i}."
        block = [
            rule(p + "ln1.weight", (h,), layer=i),
            rule(p + "ln1.bias", (h,), layer=i),
            rule(p + "attn.qkv.weight", (3 * h, h), tp_dim=0, unit=head_dim, blocks=(h, h, h), layer=i),
            rule(p + "attn.qkv.bias", (3 * h,), tp_dim=0, unit=head_dim, blocks=(h, h, h), layer=i),
            rule(p + "attn.proj.weight", (h, h), tp_dim=1, unit=head_dim, layer=i),
            rule(p + "attn.proj.bias", (h,), layer=i),
            rule(p + "ln2.weight", (h,), layer=i),
            rule(p + "ln2.bias", (h,), layer=i),
            rule(p + "mlp.fc1.weight", (fc1[0], h), tp_dim=0, split="chunk", blocks=fc1[1], layer=i),
            rule(p + "mlp.fc1.bias", (fc1[0],), tp_dim=0, split="chunk", blocks=fc1[1], layer=i),
            rule(p + "mlp.fc2.weight", (h, f), tp_dim=1, split="chunk", layer=i),
            rule(p + "mlp.fc2.bias", (h,), layer=i),
        ]
        params += [r for r in block if bias or not r.name.endswith(".bias")]
    params.append(rule("norm.weight", (h,), anchors=("last",)))
    if bias:
        params.append(rule("norm.bias", (h,), anchors=("last",)))
    if not tied:
        params.append(rule("head.weight", (vocab, h), tp_dim=0, split="pad", pad_multiple=vocab_pad_multiple,
                           anchors=("last",)))
    states = [TensorRule(optimizer_state_name(state, r.name), r.shape, optim_dtype, r.tp_dim, r.split, r.unit,
                         r.pad_multiple, r.blocks, r.layer, r.anchors, optimizer_state=True)
              for r in params for state in OPTIMIZERS[optimizer]]
    return PTC(params + states, layers=layers)
