"""Everything a training run is made of, validated in one place.

A :class:`TrainConfig` is what the CLI parses and what a checkpoint records;
:meth:`TrainConfig.check` turns impossible settings into one-line
:class:`~l2l.errors.UserError` messages before anything is built or written.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .errors import UserError
from .eps.contract import OPTIMIZERS
from .models import ModelConfig, family

ENGINES = ("l2l", "plain")
DEVICES = ("auto", "cpu", "cuda")
STASH = ("device", "host")
PRECISIONS = ("fp32", "bf16", "fp16")
OVERFLOW = ("eager", "strict")
PLAN_MODES = ("auto", "calibrated", "quick", "off")
EPS_LAYOUTS = ("sharded", "replicated")

# Settings that define the trajectory of a run: a resume must not change them.
TRAJECTORY_KEYS = ("model", "layers", "d_model", "heads", "seq_len", "dropout", "batch_size",
                   "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2",
                   "adam_eps", "seed", "data", "tokenizer", "schedule_steps", "precision", "overflow",
                   "clip_grad_norm", "weight_decay_all", "optimizer", "layer_drop",
                   "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "lora_base_dtype", "lora_init")
# What a run recorded before a setting existed did, where that is not today's default: a
# checkpoint's record without the key is read with this value (resume, export).
LEGACY_DEFAULTS = {"weight_decay_all": True}  # runs before the parameter groups decayed everything


@dataclass
class TrainConfig:
    model: str = ModelConfig.family
    layers: int = ModelConfig.layers
    d_model: int = ModelConfig.d_model
    heads: int = ModelConfig.heads
    seq_len: int = ModelConfig.seq_len
    dropout: float = ModelConfig.dropout
    init: str = ModelConfig.init  # --model DIR: pretrained (its weights) or random
    layer_drop: float = 0.0  # LayerDrop: each block left out of a step with this probability (l2l.depth)
    batch_size: int = 32
    micro_batches: int = 4
    steps: int = 300
    schedule_steps: int | None = None  # length of the cosine schedule; default: steps
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    optimizer: str = "adamw"  # the EPS's update rule (l2l.eps.contract.OPTIMIZERS)
    weight_decay: float = 0.01
    weight_decay_all: bool = False  # False: Trainer's parameter groups (no decay on biases, norms)
    beta1: float = 0.9
    beta2: float = 0.99
    adam_eps: float = 1e-8
    device: str = "auto"
    eps: str = "auto"  # auto: the fastest EPS on this host's CPU (l2l.eps.choice), never a GPU
    eps_threads: int | None = None  # threads of the CPU's EPS (numpy, opencl on a CPU); None: the affinity mask's CPUs
    cl_platform: str | None = None  # OpenCL EPS: platform index or name substring
    cl_device: str | None = None    # OpenCL EPS: device index or name substring
    cl_binary: str | None = None    # OpenCL EPS: precompiled program (.xclbin/.aocx/PoCL binary)
    board_url: str | None = None    # board EPS: udp://IP[:PORT] of the SoC's Etherbone
    eps_offload: str | None = None  # directory for the EPS state files (docs/disk-tier.md); None: in memory
    eps_offload_window: int = 2     # --eps-offload: entries read ahead of the updates (and written behind)
    eps_offload_copies: bool = False  # --eps-offload: the device copies in files too, read ahead in fetch order
    engine: str = "l2l"
    devices: int = 1  # relay workers in this box (GPUs, or CPU workers), one EPS contribution each
    check_every: int = 50  # steps between master-weight checksums across machines (torchrun)
    eps_layout: str = "sharded"  # several machines: each owns 1/R of the EPS, or each holds all of it
    checkpointing: bool = False
    accumulate: bool = False  # plain engine: run the batch as --micro-batches micro-batches
    stash: str = "device"
    precision: str = "fp32"  # what the device computes in; the EPS keeps fp32 masters either way
    overflow: str = "eager"  # eager: per-layer skip on overflow; strict: whole step, GradScaler-exact
    clip_grad_norm: float | None = None  # global-norm clipping (needs --overflow strict on l2l)
    seed: int = 0
    data: str | None = None
    tokenizer: str | None = None  # "bytes", a tokenizer directory, or None: the model directory's, else bytes
    out: str | None = None
    resume: bool = False
    eval_every: int = 100
    eval_batches: int = 4
    save_every: int = 0
    keep_checkpoints: int = 2
    progress: bool = True
    plot: bool = True
    plan: str | None = None  # planner forecast: auto | calibrated | quick | off (default: auto with progress)
    # LoRA over a frozen base (l2l.lora, docs/lora.md); None: peft's default, or no LoRA (rank)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None  # comma-separated module names
    lora_dropout: float | None = None
    lora_base_dtype: str = "bf16"
    lora_init: str | None = None  # a PEFT adapter directory the adapters start from

    @property
    def plan_mode(self) -> str:
        return self.plan or ("auto" if self.progress else "off")

    def eps_choice(self):
        """The EPS backend this run gets (``--eps auto`` resolved on this host) and its options."""
        from .eps.choice import choose
        return choose(self.eps, cl_platform=self.cl_platform, cl_device=self.cl_device, cl_binary=self.cl_binary,
                      threads=self.eps_threads, optimizer=self.optimizer, board_url=self.board_url)

    def model_config(self) -> ModelConfig:
        return ModelConfig(family=self.model, layers=self.layers, d_model=self.d_model,
                           heads=self.heads, seq_len=self.seq_len, dropout=self.dropout, init=self.init,
                           decay_groups=not self.weight_decay_all)

    @property
    def total_schedule_steps(self) -> int:
        return self.schedule_steps if self.schedule_steps is not None else self.steps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The config of a dict with these fields and maybe others (parsed options, a checkpoint's record)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_record(cls, d: dict) -> "TrainConfig":
        """The config a checkpoint recorded, its missing settings read as what they did then."""
        return cls.from_dict({**LEGACY_DEFAULTS, **d})

    def trajectory(self) -> dict:
        d = self.to_dict()
        d["schedule_steps"] = self.total_schedule_steps
        return {k: d[k] for k in TRAJECTORY_KEYS}

    def check(self) -> "TrainConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UserError(msg)

        family(self.model)  # a built-in family or a model directory whose family is supported
        need(self.init in ("pretrained", "random") or (self.init == "checkpoint" and self.resume),
             f"unknown --init {self.init!r}; choose pretrained or random")  # checkpoint: a resume's (run_model.py)
        from .eps import BACKENDS
        from .eps.choice import AUTO, check_threads
        need(self.eps in BACKENDS or self.eps == AUTO,
             f"unknown EPS backend {self.eps!r}; choose {AUTO} or one of {', '.join(BACKENDS)}")
        need(self.eps == "opencl" or not (self.cl_platform or self.cl_device or self.cl_binary),
             "--cl-platform/--cl-device/--cl-binary choose the device of --eps opencl (auto never takes a GPU "
             "or an accelerator unnamed): add --eps opencl")
        check_threads(self.eps, self.eps_threads)
        need(self.eps == "board" or self.board_url is None, "--board-url is the address of --eps board: add --eps board")
        if self.eps == "board":
            need(self.board_url is not None, "--eps board needs --board-url udp://IP[:PORT] (the board's address)")
            need(self.optimizer == "adamw", f"--eps board runs AdamW (the bitstream's kernel), not --optimizer "
                 f"{self.optimizer}")
            need(self.precision == "fp32", f"--eps board takes fp32 gradients and copies (the bitstream's kernel), "
                 f"not --precision {self.precision}")
            need(self.eps_offload is None, "--eps board keeps the EPS state in the board's DRAM: no --eps-offload")
        need(self.eps_offload is None or self.engine == "l2l",
             "--eps-offload applies to --engine l2l (the plain baseline has no EPS)")
        need(self.eps_offload is None or self.eps_offload.strip() != "", "--eps-offload needs a directory")
        need(not self.eps_offload_copies or self.eps_offload is not None,
             "--eps-offload-copies needs --eps-offload DIR")
        need(not self.eps_offload_copies or self.device != "cuda",
             "--eps-offload-copies is not supported with --device cuda yet (docs/disk-tier.md)")
        need(self.eps_offload_window >= 1, f"--eps-offload-window must be at least 1 (got {self.eps_offload_window})")
        need(self.engine in ENGINES, f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        need(self.device in DEVICES, f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        need(self.precision in PRECISIONS,
             f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        need(self.overflow in OVERFLOW, f"unknown --overflow {self.overflow!r}; choose one of {', '.join(OVERFLOW)}")
        need(self.clip_grad_norm is None or self.clip_grad_norm > 0,
             f"--clip-grad-norm must be positive (got {self.clip_grad_norm})")
        need(self.clip_grad_norm is None or self.engine == "plain" or self.overflow == "strict",
             "--clip-grad-norm needs --overflow strict: eager updates cannot wait for the global gradient norm")
        need(self.devices >= 1, f"--devices must be at least 1 (got {self.devices})")
        need(self.devices == 1 or self.engine == "l2l", "--devices applies to --engine l2l")
        need(self.micro_batches % self.devices == 0,
             f"--micro-batches {self.micro_batches} must be a multiple of --devices {self.devices} "
             "(each device runs its share of the global micro-batches)")
        need(self.check_every >= 0, "--check-every must be >= 0")
        need(self.eps_layout in EPS_LAYOUTS,
             f"unknown --eps-layout {self.eps_layout!r}; choose one of {', '.join(EPS_LAYOUTS)}")
        need(self.stash in STASH, f"unknown stash {self.stash!r}; choose one of {', '.join(STASH)}")
        need(self.layers >= 1, f"--layers must be at least 1 (got {self.layers})")
        need(self.d_model >= 1 and self.heads >= 1, "--d-model and --heads must be positive")
        need(self.d_model % self.heads == 0,
             f"--d-model {self.d_model} is not a multiple of --heads {self.heads}")
        need(self.seq_len >= 2, f"--seq-len must be at least 2 (got {self.seq_len})")
        need(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1) (got {self.dropout})")
        need(0.0 <= self.layer_drop < 1.0, f"--layer-drop must be in [0, 1) (got {self.layer_drop})")
        need(self.batch_size >= 1, f"--batch-size must be positive (got {self.batch_size})")
        need(self.micro_batches >= 1, f"--micro-batches must be positive (got {self.micro_batches})")
        need(self.batch_size % self.micro_batches == 0,
             f"--micro-batches {self.micro_batches} does not divide --batch-size {self.batch_size}")
        need(self.steps >= 0, f"--steps must be >= 0 (got {self.steps})")
        need(self.total_schedule_steps >= self.steps or self.schedule_steps is None,
             "--schedule-steps must be at least --steps")
        need(self.optimizer in OPTIMIZERS,
             f"unknown --optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        need(self.lr > 0, f"--lr must be positive (got {self.lr})")
        need(0.0 <= self.min_lr_ratio <= 1.0, "--min-lr-ratio must be in [0, 1]")
        need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        need(self.weight_decay >= 0 and self.lr * self.weight_decay < 1,
             "--weight-decay must be >= 0 and lr * weight_decay < 1")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1/--beta2 must be in [0, 1)")
        need(self.adam_eps > 0, "--adam-eps must be positive")
        need(self.eval_every >= 0 and self.save_every >= 0, "--eval-every/--save-every must be >= 0")
        need(self.eval_batches >= 1, "--eval-batches must be positive")
        need(self.keep_checkpoints >= 1, "--keep-checkpoints must be at least 1")
        need(self.seed >= 0, "--seed must be >= 0")
        need(self.plan is None or self.plan in PLAN_MODES,
             f"unknown --plan {self.plan!r}; choose one of {', '.join(PLAN_MODES)}")
        need(not (self.accumulate and self.engine == "l2l"),
             "--accumulate applies to --engine plain (the relay always runs --micro-batches micro-batches)")
        need(not (self.checkpointing and self.engine == "l2l"),
             "--checkpointing applies to --engine plain (the relay always recomputes)")
        from .lora import check_options
        check_options(self)
        return self
