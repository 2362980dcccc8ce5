"""What a LoRA run trains: rank, alpha, targets, dropout, the base's dtype -- checked in one place.

Defaults are peft's, so that ``--lora-rank R`` alone means what ``LoraConfig(r=R)`` means to a
peft user: ``lora_alpha`` 8, dropout 0, and the target modules peft picks for the model type
(``q_proj,v_proj`` for Llama-style decoders). ``--lora-init DIR`` takes them from the adapter's
``adapter_config.json`` instead; an option given beside it must agree with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

BASE_DTYPES = ("bf16", "fp16")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float
    base_dtype: str
    init: str | None  # a PEFT adapter directory the adapters start from; None: peft's initialisation

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # peft's LoraLayer: lora_alpha / r (no rsLoRA)

    def peft_config(self):
        from peft import LoraConfig
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.targets),
                          lora_dropout=self.dropout)

    def to_dict(self) -> dict:
        """As the stack's config records it (a checkpoint's signature): what shapes the adapters."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}


def enabled(cfg) -> bool:
    return cfg.lora_rank is not None or cfg.lora_init is not None


def check_options(cfg) -> None:
    """One line for each LoRA option that cannot apply (``TrainConfig.check`` calls this)."""
    given = [flag for flag, value in (("--lora-alpha", cfg.lora_alpha), ("--lora-targets", cfg.lora_targets),
                                      ("--lora-dropout", cfg.lora_dropout)) if value is not None]
    if not enabled(cfg):
        if given or cfg.lora_base_dtype != "bf16":
            raise UserError(f"{given[0] if given else '--lora-base-dtype'} needs --lora-rank R (or --lora-init DIR)")
        return
    if cfg.engine != "l2l":
        raise UserError("--lora-rank runs on --engine l2l (the plain baseline trains every weight)")
    if cfg.devices != 1:
        raise UserError("--lora-rank takes one relay worker (--devices 1) for now")
    if cfg.eps_offload is not None:
        raise UserError("--lora-rank keeps the adapters' state in memory: no --eps-offload (docs/lora.md)")
    if cfg.lora_rank is not None and cfg.lora_rank < 1:
        raise UserError(f"--lora-rank must be at least 1 (got {cfg.lora_rank})")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise UserError(f"--lora-alpha must be positive (got {cfg.lora_alpha})")
    if cfg.lora_dropout is not None and not 0.0 <= cfg.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    if cfg.lora_base_dtype not in BASE_DTYPES:
        raise UserError(f"unknown --lora-base-dtype {cfg.lora_base_dtype!r}; choose one of {', '.join(BASE_DTYPES)}")
    if cfg.lora_targets is not None and not _targets(cfg.lora_targets):
        raise UserError("--lora-targets needs module names, comma-separated (e.g. q_proj,v_proj)")


def check_model(cfg) -> None:
    """A LoRA run trains adapters over a model directory's weights; ``l2l plan`` also takes a
    built-in model's shape (a base of that shape), so this is checked when the run builds."""
    from ..models.pretrained import is_model_dir
    if not is_model_dir(cfg.model):
        raise UserError(f"--lora-rank trains adapters over a model directory's weights (--model DIR), "
                        f"not --model {cfg.model}")
    if cfg.init == "random":
        raise UserError("--lora-rank trains adapters over pretrained weights: not with --init random")


def lora_spec(cfg, model_type: str) -> LoraSpec | None:
    """The run's LoRA (None: a full fine-tune), its defaults filled in as peft fills them."""
    if not enabled(cfg):
        return None
    try:
        from peft import LoraConfig
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS
    except ImportError:
        raise UserError("--lora-rank needs peft: pip install 'l2l[lora]'") from None
    given = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
             "targets": tuple(sorted(_targets(cfg.lora_targets))) if cfg.lora_targets is not None else None}
    if cfg.lora_init is not None:
        saved = adapter_config(cfg.lora_init)
        for key, value in given.items():
            if value is not None and value != saved[key]:
                raise UserError(f"--lora-{key} {value!r} differs from the {saved[key]!r} of --lora-init {cfg.lora_init}")
        given = saved
    defaults = LoraConfig(r=given["rank"])
    targets = given["targets"] or tuple(sorted(DEFAULT_TARGETS.get(model_type, ())))
    if not targets:
        raise UserError(f"peft names no default LoRA targets for {model_type}: pass --lora-targets")
    return LoraSpec(rank=given["rank"], alpha=float(given["alpha"] if given["alpha"] is not None else defaults.lora_alpha),
                    targets=tuple(targets), dropout=float(given["dropout"] or 0.0),
                    base_dtype=cfg.lora_base_dtype, init=cfg.lora_init)


def _targets(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def adapter_config(directory: str) -> dict:
    """rank, alpha, targets and dropout of a PEFT LoRA adapter directory; one line for anything
    l2l does not train the same way (DoRA, rsLoRA, biases, per-module ranks, extra modules)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--lora-init {directory}: no readable {ADAPTER_CONFIG} ({exc})") from None
    if not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"--lora-init {directory}: no {ADAPTER_WEIGHTS}")
    targets = config.get("target_modules")
    unlike = [key for key, plain in (("peft_type", "LORA"), ("use_dora", False), ("use_rslora", False),
                                     ("bias", "none"), ("modules_to_save", None), ("fan_in_fan_out", False),
                                     ("lora_bias", False), ("layers_to_transform", None), ("exclude_modules", None),
                                     ("target_parameters", None))
              if config.get(key, plain) != plain] + [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if unlike or not isinstance(targets, list):
        what = f"{unlike[0]} {config.get(unlike[0])!r}" if unlike else f"target_modules {targets!r}"
        raise UserError(f"--lora-init {directory}: {ADAPTER_CONFIG} sets {what}; l2l trains plain LoRA adapters "
                        "of a list of target modules")
    return {"rank": config["r"], "alpha": config["lora_alpha"], "dropout": config.get("lora_dropout", 0.0),
            "targets": tuple(sorted(targets))}
