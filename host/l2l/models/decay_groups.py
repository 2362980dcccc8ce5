"""Which parameters weight decay applies to: the groups Hugging Face's ``Trainer`` makes.

``Trainer.get_decay_parameter_names`` leaves out every parameter of an ``nn.LayerNorm``
and every parameter whose lowercased dotted name matches one of the patterns below
(biases and normalisation weights); everything else, embeddings included, is decayed.
l2l applies the same rule to each layer's module, so a fine-tune here decays what the
same fine-tune under ``Trainer`` decays (``tests/test_decay_groups.py`` checks the two
agree on every model family). The rule is restated rather than imported because importing
``Trainer`` takes seconds and the built-in model needs no transformers at all.
"""
from __future__ import annotations

import re

from torch import nn

NO_DECAY_PATTERNS = tuple(re.compile(p) for p in (
    r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"))


def no_decay_names(module: nn.Module) -> frozenset[str]:
    """Names (``module.named_parameters()``'s) of the parameters weight decay leaves alone."""
    in_norm = {id(p) for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return frozenset(name for name, p in module.named_parameters()
                     if id(p) in in_norm or any(pat.search(name.lower()) for pat in NO_DECAY_PATTERNS))

