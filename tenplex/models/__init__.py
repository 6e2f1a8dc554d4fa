"""Reference models whose tensor names follow tenplex's built-in partition rules.

May import: torch, torch.distributed, ``tenplex.parallel``, ``tenplex.gpt``,
``tenplex.errors`` and the standard library. Nothing below imports this package.

:mod:`tenplex.models.gpt` is the small GPT that the example, ``tenplex demo``,
``tenplex bench restore`` and the tests train. Its state-dict names and shapes
are those of :func:`tenplex.gpt.gpt` (fused q|k|v included), so a layout made
from the rules names the model's tensors. A new model family adds its partition
rules next to :mod:`tenplex.gpt` (pure) and, when it ships a reference model,
that model here.
"""
