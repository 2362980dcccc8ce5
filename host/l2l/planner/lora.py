"""What a LoRA run (``--lora-rank``) keeps on the host, for the planner.

The frozen base costs its dtype's 2 bytes a parameter and no optimizer state
(``l2l.lora.frozen``); only the adapters are EPS entries, at the EPS's bytes a parameter
(fp32 master and moments, and the device copy) like any trained parameter. The adapters are
counted by formula, not built: per block, each target's A (r x d) and B (d x r), with every
target taken as d x d -- exact for the attention projections of a model whose key/value
heads are its query heads, an upper bound for grouped-query attention's k/v and a low
count for MLP projections (d x 4d). The targets are ``--lora-targets``, or peft's default
for Llama-style decoders, q_proj and v_proj (two).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lora.spec import enabled

DEFAULT_TARGETS = 2  # peft's default for Llama-style decoders: q_proj, v_proj
BASE_BYTES = {"bf16": 2, "fp16": 2}
# what importing transformers, its Llama modelling and peft adds to the resident set of a
# process that has torch and l2l already (the runtime the planner starts from): a LoRA run
# trains a model directory, so it always pays it; measured on this project's CPU machine
# (torch 2.13, transformers 5.25, peft 0.21): 203 MiB
IMPORT_BYTES = 203 << 20


@dataclass(frozen=True)
class LoraSizes:
    adapter_params: int  # what the EPS holds and updates
    base_bytes: int      # the frozen store
    largest_entry: int   # one block's adapters: the largest gradient inbox
    import_bytes: int = IMPORT_BYTES  # transformers and peft in the process (host, fixed)

    def compute_copy_bytes(self, largest: int, db: int, on_cuda: bool) -> int:
        """The host bytes of the fetched layer's frozen weights cast to the compute dtype: on the CPU
        device a copy of their own (the EPS's weights are views of its masters; these are not),
        the largest layer's; on CUDA the cast happens on the device, which the device ledger counts."""
        return 0 if on_cuda else largest * db


def lora_sizes(cfg, params: int, blocks: int) -> LoraSizes | None:
    """The sizes of ``cfg``'s LoRA over a base of ``params`` parameters and ``blocks`` blocks
    of width ``cfg.d_model``; None when ``cfg`` trains every parameter."""
    if not enabled(cfg):
        return None
    rank = cfg.lora_rank
    if rank is None:  # --lora-init DIR: its config's
        from ..lora.spec import adapter_config
        rank = adapter_config(cfg.lora_init)["rank"]
    targets = len([t for t in (cfg.lora_targets or "").split(",") if t.strip()]) or DEFAULT_TARGETS
    per_block = targets * 2 * rank * cfg.d_model
    return LoraSizes(blocks * per_block, params * BASE_BYTES[cfg.lora_base_dtype], per_block)
