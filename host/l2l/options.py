"""Command-line options, each defined once.

``l2l train``, ``l2l plan`` and the benchmarks take their model-shape and run
options from the groups here, so a flag has one name, one type, one default
(:class:`~l2l.config.TrainConfig`'s) and one help text everywhere. Values are
checked by :meth:`TrainConfig.check`, which words every mistake as one line.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .eps.contract import OPTIMIZERS
from .config import DEVICES, ENGINES, EPS_LAYOUTS, OVERFLOW, PLAN_MODES, PRECISIONS, STASH, TrainConfig
from .errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UserError` (one line, exit 2) instead of printing usage first."""

    def error(self, message: str):  # noqa: D401
        raise UserError(message)


@dataclass(frozen=True)
class Option:
    flag: str
    help: str = ""
    type: Callable | None = None
    action: str | None = None  # "store_true" / "store_false"
    dest: str | None = None     # the TrainConfig field, when not the flag's own name

    @property
    def field(self) -> str:
        return self.dest or self.flag.lstrip("-").replace("-", "_")


def _one_of(names: Sequence[str]) -> str:
    return " | ".join(names)


MODEL = (
    Option("--model", "gpt | hf-gpt2 | hf-bert, or a Hugging Face model directory (config.json and "
           "safetensors; llama, mistral, qwen2, qwen3) (default %(default)s)"),
    Option("--init", "with a model directory: pretrained (its weights, default) | random (its architecture, "
           "fresh weights)"),
    Option("--layers", "transformer blocks (default %(default)s)", int),
    Option("--d-model", "width (default %(default)s)", int),
    Option("--heads", "attention heads (default %(default)s)", int),
    Option("--seq-len", "tokens per sequence (default %(default)s)", int),
    Option("--dropout", "dropout probability (default %(default)s)", float),
    Option("--layer-drop", "LayerDrop: each block is left out of a training step with this probability, drawn "
           "per step from --seed (not fetched, not computed, not updated; evaluation runs every block; "
           "default %(default)s)", float),
)
BATCH = (
    Option("--batch-size", "global batch: sequences per step (default %(default)s)", int),
    Option("--micro-batches", "M: the relay runs each layer over M micro-batches; must divide --batch-size "
           "(default %(default)s)", int),
)
DEVICE = (
    Option("--device", f"{_one_of(DEVICES)} (default %(default)s)"),
)
RELAY = (
    Option("--engine", f"{_one_of(ENGINES)} (default %(default)s)"),
    Option("--devices", "relay workers in this box, one per GPU (CPU workers without one), all feeding one EPS "
           "(default %(default)s)", int),
    Option("--stash", f"{_one_of(STASH)}: where stashed activations wait (default %(default)s)"),
    Option("--precision", f"{_one_of(PRECISIONS)}: what the device computes in (fp16 with dynamic loss scaling; "
           "default %(default)s)"),
    Option("--overflow", f"{_one_of(OVERFLOW)}; eager: an overflowing layer skips its own update (default); strict: updates wait for "
           "the end of backward and the whole step is applied or skipped, as torch's GradScaler does"),
    Option("--clip-grad-norm", "clip gradients to this global L2 norm (needs --overflow strict with --engine l2l)",
           float),
    Option("--checkpointing", "plain engine: recompute blocks in backward", action="store_true"),
    Option("--accumulate", "plain engine: run the batch as --micro-batches micro-batches, accumulating "
           "gradients (default: the whole batch at once)", action="store_true"),
)
EPS = (
    Option("--eps", "EPS backend: auto | numpy | opencl | hls-csim | rtl (the Verilog kernel in Verilator) | board (an FPGA "
           "board over Ethernet, --board-url); auto: the fastest on this host's CPU, the "
           "OpenCL EPS on an OpenCL CPU device, else NumPy on every core; never a GPU (default %(default)s; "
           "`l2l info` says what auto takes here)"),
    Option("--eps-threads", "threads of the EPS on the CPU (numpy, or opencl on a CPU device; default: every CPU "
           "this process may run on)", int),
    Option("--cl-platform", "OpenCL platform: index or name substring (env L2L_CL_PLATFORM)"),
    Option("--cl-device", "OpenCL device: index or name substring (env L2L_CL_DEVICE)"),
    Option("--cl-binary", "precompiled OpenCL program (.xclbin, .aocx) for the OpenCL EPS"),
    Option("--board-url", "--eps board: the board's Etherbone address, udp://IP[:PORT] (port 1234 by default; "
           "docs/fpga.md)"),
    Option("--eps-layout", f"under torchrun: {_one_of(EPS_LAYOUTS)}; sharded: each of R machines owns 1/R of "
           "every EPS entry (weights, moments, update), so R machines hold an R times larger model, with the bits "
           "of one machine; replicated: each holds all of it (default %(default)s)"),
    Option("--eps-offload", "keep the EPS's fp32 weights and AdamW moments in files in this directory instead of "
           "host memory, read ahead of the updates and written behind them (docs/disk-tier.md; default: in memory)"),
    Option("--eps-offload-window", "with --eps-offload: layers read ahead of the updates, and at most as many "
           "waiting to be written (default %(default)s)", int),
    Option("--eps-offload-copies", "with --eps-offload: keep the device copies of the weights in files there too, "
           "a few read ahead in fetch order (default: in memory; not with --device cuda yet)", action="store_true"),
)
OPTIMIZER = (
    Option("--steps", "optimizer steps (default %(default)s)", int),
    Option("--schedule-steps", "length of the cosine learning-rate schedule (default: --steps)", int),
    Option("--lr", "peak learning rate (default %(default)s)", float),
    Option("--min-lr-ratio", "the schedule's floor as a share of --lr (default %(default)s)", float),
    Option("--warmup-steps", "linear warm-up steps (default %(default)s)", int),
    Option("--optimizer", f"{_one_of(OPTIMIZERS)}: the update the EPS runs; Lion keeps one moment, 8 bytes of "
           "state a parameter instead of 12, and wants a smaller --lr; LAMB scales each decayed tensor's step by "
           "its trust ratio |w|/|update| (default %(default)s)"),
    Option("--weight-decay", "decoupled weight decay (default %(default)s)", float),
    Option("--weight-decay-all", "decay every parameter; default: none on biases and normalisation weights, "
           "as Hugging Face's Trainer groups them", action="store_true"),
    Option("--beta1", "AdamW's beta1; Lion's interpolation for the step's sign (default %(default)s)", float),
    Option("--beta2", "AdamW's beta2; Lion's momentum decay (default %(default)s)", float),
    Option("--adam-eps", "AdamW's and LAMB's epsilon (default %(default)s)", float),
    Option("--seed", "seeds the initial weights, the data order and dropout (default %(default)s)", int),
)
RUN = (
    Option("--data", "text file, folder, or .jsonl with a 'text' field per record (default: this Python's "
           "stdlib sources)"),
    Option("--tokenizer", "bytes | a tokenizer directory (default: the --model directory's tokenizer when it has "
           "one, else bytes)"),
    Option("--out", "run directory (default runs/MODEL-ENGINE)"),
    Option("--resume", "continue the run in --out from its latest checkpoint", action="store_true"),
    Option("--eval-every", "steps between validations (0: at the end only; default %(default)s)", int),
    Option("--eval-batches", "validation batches (default %(default)s)", int),
    Option("--save-every", "steps between checkpoints (0: at the end only; default %(default)s)", int),
    Option("--keep-checkpoints", "checkpoints kept (default %(default)s)", int),
    Option("--check-every", "under torchrun: steps between checks that every machine holds the same master "
           "weights (default %(default)s)", int),
    Option("--no-progress", "no progress bar or messages", action="store_false", dest="progress"),
    Option("--no-plot", "no metrics.png", action="store_false", dest="plot"),
    Option("--plan", f"planner forecast printed beside the measured step time: {_one_of(PLAN_MODES)} (default "
           "auto: calibrates when that costs <= 5%% of the run; off with --no-progress)"),
)
LORA = (
    Option("--lora-rank", "train LoRA adapters of this rank over the frozen --model DIR, whose weights stay on "
           "the host in --lora-base-dtype with no optimizer state (docs/lora.md; default: train every weight)", int),
    Option("--lora-alpha", "LoRA's alpha: the adapters' output is scaled by alpha / rank (default: peft's, 8)",
           float),
    Option("--lora-targets", "comma-separated names of the linear modules to adapt (default: peft's for the "
           "model type; q_proj,v_proj for Llama-style decoders)"),
    Option("--lora-dropout", "dropout on the adapters' input (default 0)", float),
    Option("--lora-base-dtype", "bf16 | fp16: the frozen base's dtype on the host (default %(default)s)"),
    Option("--lora-init", "a PEFT adapter directory to start from (its adapter_config.json sets rank, alpha, "
           "targets and dropout)"),
)
TRAIN = MODEL + BATCH + DEVICE + RELAY + EPS + OPTIMIZER + LORA + RUN


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option], *,
                defaults: dict | None = None, several: Sequence[str] = ()) -> None:
    """Add ``options`` to ``parser`` with TrainConfig's defaults, or ``defaults`` (by field);
    the fields in ``several`` take one or more values (a benchmark's sweep)."""
    base = TrainConfig().to_dict()
    defaults = defaults or {}
    for opt in options:
        default = defaults.get(opt.field, base[opt.field])
        kwargs = {"dest": opt.field, "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
        else:
            kwargs.update(type=opt.type, default=default)
            if opt.field in several:
                kwargs.update(nargs="+", default=list(default) if isinstance(default, (list, tuple)) else [default])
        parser.add_argument(opt.flag, **kwargs)


def config_from(args: argparse.Namespace, **overrides) -> TrainConfig:
    """The TrainConfig of parsed ``args`` (fields they do not carry keep their defaults)."""
    return replace(TrainConfig.from_dict(vars(args)), **overrides)
