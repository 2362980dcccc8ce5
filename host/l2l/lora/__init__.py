"""LoRA over a streamed frozen base (``l2l train --model DIR --lora-rank R``).

The base model is frozen and kept once on the host in bf16 (or fp16: ``--lora-base-dtype``)
by :class:`~.frozen.FrozenBase`, with no optimizer state; each layer's LoRA adapters (peft's
``lora_A``/``lora_B`` of every targeted linear in it) are that layer's EPS entry, with fp32
masters and AdamW state like any other. The adapters are peft's own modules, injected into
the model on the meta device before it is cut into a stack (:mod:`.build`), so the maths is
peft's ``LoraLayer``'s; the relay binds the frozen weights beside the adapters and computes
gradients for the adapters only (``relay/engine.py``). Adapter files are peft's format both
ways (:mod:`.adapter_files`): ``--lora-init DIR`` starts from a PEFT adapter directory and
``l2l export`` writes one (or, with ``--merge``, the merged model). docs/lora.md has the why.
"""
from .spec import LoraSpec, check_options, lora_spec

__all__ = ["LoraSpec", "check_options", "lora_spec"]
