"""``l2l plan``: predict a relay step's time and memory before running it.

From the model's shape (a :class:`~l2l.config.TrainConfig`) and three rates of
the machine -- the device's compute rate (FLOP/s), the host<->device link
(bytes/s; the CPU device is zero-copy) and the EPS update rate (elements/s) --
:func:`predict` replays the relay's schedule (``relay/engine.py``) layer by
layer and returns a :class:`Prediction`: step time, how much of the weight and
gradient traffic hides under compute, how much of the EPS's work is exposed,
device memory (what the relay's ledger counts, plus a rough estimate of one
layer's transient activations) and host memory. :func:`measure_rates` measures
the rates here; :func:`choose_micro_batches` picks M; :func:`run_plan` is the
command line.

The model, in short (each term is stated where it is computed):

* **FLOPs.** A layer's forward over ``t`` tokens is ``2 * w * t`` for the ``w``
  weights it multiplies with (biases, norms and embedding gathers are not
  matmuls), plus ``4 * b * T^2 * d`` for causal attention in a block (``QK^T``
  and ``AV``; counted whole although half of it is masked). The relay runs each
  block forward once, then recomputes it (1x) and back-propagates (2x): 4x
  the forward in all, less what the recompute skips -- it stops once backward
  has every tensor it needs, before a GPT block's output projection (``4d^2``
  of its ``12d^2`` matmul weights). The post stage runs forward and backward
  once: 3x.
* **Compute time** of one layer over one micro-batch is ``flops / (rate *
  efficiency) + per_call_s`` for a forward call, three times that for a
  recompute + backward call. ``rate`` is a dense matmul's rate at the
  micro-batch's GEMM shape (measured, or given). ``efficiency`` and
  ``per_call_s`` (launches, autograd, Python, OpenMP fork/join: what a call
  costs whatever its size) are fitted to real relay steps of the same shape
  cut to 4 blocks, at M = 1 and M = 8 (:func:`calibrate`): attention, norms,
  GELU and small micro-batches keep the relay below the matmul's rate, and
  the pure-FLOP model (efficiency 1, no per-call cost) predicts steps 16-28%
  too short here.
* **Transfers** (CUDA): a layer's weights cross the link twice per step
  (forward, backward) and its gradient once. Weights move on a copy stream
  while the previous layer computes (the relay prefetches one layer ahead), so
  per layer the step advances by about ``max(compute_i, transfer_{i+1})``;
  gradients go out on a second stream (full duplex). On the CPU the transport
  hands the EPS buffers to torch: no transfer at all.
* **EPS.** Each layer's update is queued on one worker as soon as its gradient
  is out, and runs ``numel / eps_rate`` seconds, in order. The next step needs
  layer 0 first, whose update is queued last, so what the worker has not
  finished when the backward ends is exposed; the rest hides under backward.

Accuracy on the project's 2-core CPU (torch 2.13, 2 threads, quiet machine),
gpt d 256, 4 heads, seq 128, batch 16, the ``l2l bench relay`` grid (2-16
blocks, M = 1, 2, 4, 8), rates measured and calibrated once on that shape:
within 3.3% (mean 1.4%) of the relay timed alone (median of 5 steps), within
14% (mean 5.5%) of ``l2l bench relay`` run in the same session, which steps
six engines in turn and so times each relay 1-13% slower than alone, the more
so the larger M.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from .config import TrainConfig
from .errors import UserError

# bytes per element of what the device computes in (weights, their device copy,
# gradients and activations); the EPS keeps fp32 master weights and moments.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EPS_STATE_BYTES = 12  # fp32 p, m, v per parameter on the host


# ---------------------------------------------------------------- model shape

@dataclass(frozen=True)
class LayerShape:
    """What the planner needs of one layer of the stack."""

    name: str
    kind: str           # "pre" | "block" | "post"
    params: int         # elements of the layer's flat buffer (what the EPS stores)
    matmul_params: int  # weights used in matrix products: 2 * this FLOPs per token
    attention: bool     # a block: causal self-attention over the sequence
    tail_matmul_params: int = 0  # of those, used after the last tensor backward needs:
    #                              the early-stopping recompute skips them

    def forward_flops(self, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one forward over ``batch`` sequences of ``seq_len`` tokens."""
        tokens = batch * seq_len
        flops = 2.0 * self.matmul_params * tokens
        if self.attention:
            flops += 4.0 * batch * seq_len * seq_len * d_model  # QK^T and AV, 2*b*T^2*d each
        return flops

    def backward_flops(self, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one recompute (stopping early) + backward over ``batch`` sequences."""
        return (3.0 * self.forward_flops(batch, seq_len, d_model)
                - 2.0 * self.tail_matmul_params * batch * seq_len)

    def pass_flops(self, kind: str, batch: int, seq_len: int, d_model: int) -> float:
        """FLOPs of one call of the relay's pass ``kind`` ("fwd", "post", "bwd")."""
        if kind == "fwd":
            return self.forward_flops(batch, seq_len, d_model)
        return self.backward_flops(batch, seq_len, d_model)  # the post stage has no tail: 3x forward


def gpt_layer_shapes(layers: int, d_model: int, seq_len: int, vocab: int = 256) -> list[LayerShape]:
    """The built-in GPT (``models/gpt.py``), counted by hand.

    pre: token + position embeddings, ``vocab*d + T*d``; a block: qkv ``3d^2+3d``,
    proj ``d^2+d``, fc ``4d^2+4d``, out ``4d^2+d``, two layer norms ``4d``:
    ``12d^2 + 13d``, of which ``12d^2`` multiply (the last, out's ``4d^2``, after
    every tensor backward needs); post: norm ``2d`` and the untied head ``d*vocab``.
    """
    d = d_model
    shapes = [LayerShape("pre", "pre", vocab * d + seq_len * d, 0, False)]
    shapes += [LayerShape(f"block.{i}", "block", 12 * d * d + 13 * d, 12 * d * d, True, 4 * d * d) for i in range(layers)]
    shapes.append(LayerShape("post", "post", d * vocab + 2 * d, d * vocab, False))
    return shapes


def layer_shapes(cfg: TrainConfig) -> list[LayerShape]:
    """Per-layer sizes of ``cfg``'s stack: by formula for ``gpt``, otherwise counted
    on the stack built on the meta device (:func:`_meta_layer_shapes`)."""
    if cfg.model == "gpt":
        from .models.config import BYTE_VOCAB
        return gpt_layer_shapes(cfg.layers, cfg.d_model, cfg.seq_len, BYTE_VOCAB)
    return _meta_layer_shapes(cfg)


def _meta_layer_shapes(cfg: TrainConfig) -> list[LayerShape]:
    """Build the stack on the meta device (shapes only: no memory, no init) and count:
    every parameter of a layer, and as matmul weights its 2-D parameters outside
    embeddings (``nn.Linear``, HF's ``Conv1D``)."""
    from .models import build_stack
    with torch.device("meta"):
        stack = build_stack(cfg.model_config(), 0)
    shapes = []
    for layer in stack.layers:
        matmul = 0
        for module in layer.module.modules():
            if isinstance(module, torch.nn.Embedding):
                continue  # a gather, not a product
            matmul += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        shapes.append(LayerShape(layer.name, layer.kind, layer.layout.numel, matmul, layer.kind == "block"))
    return shapes


def dtype_bytes_of(cfg: TrainConfig, dtype_bytes: int | None = None) -> int:
    """``dtype_bytes`` when given, else what ``cfg.precision`` computes in (fp32 when absent)."""
    if dtype_bytes is not None:
        if dtype_bytes not in (1, 2, 4, 8):
            raise UserError(f"dtype bytes must be 1, 2, 4 or 8 (got {dtype_bytes})")
        return dtype_bytes
    precision = getattr(cfg, "precision", "fp32")
    return DTYPE_BYTES.get(precision, 4)


# ---------------------------------------------------------------- rates

@dataclass(frozen=True)
class Rates:
    """What the machine does per second, measured (:func:`measure_rates`) or given.

    ``flops_per_s`` is a dense matmul's rate. ``efficiency`` is the relay's
    achieved share of it and ``per_call_s`` its fixed cost per layer per
    micro-batch per forward call (a recompute + backward call counts 3), both
    fitted by :func:`calibrate`; given rates default to the pure-FLOP model
    (1 and 0). ``link_bytes_per_s`` is host->device, None for a zero-copy
    device (the CPU); ``link_out_bytes_per_s`` device->host, defaulting to it.
    """

    flops_per_s: float
    link_bytes_per_s: float | None = None
    eps_elems_per_s: float = 5e8
    efficiency: float = 1.0
    per_call_s: float = 0.0
    link_out_bytes_per_s: float | None = None
    device: str = "cpu"
    notes: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.flops_per_s > 0 or not self.eps_elems_per_s > 0 or not self.efficiency > 0:
            raise UserError("compute rate, EPS rate and efficiency must be positive")
        for bw in (self.link_bytes_per_s, self.link_out_bytes_per_s):
            if bw is not None and not bw > 0:
                raise UserError("link bandwidth must be positive (or None for a zero-copy device)")
        if self.per_call_s < 0:
            raise UserError("per-call overhead must be >= 0")

    @property
    def zero_copy(self) -> bool:
        return self.link_bytes_per_s is None or math.isinf(self.link_bytes_per_s)

    def seconds_in(self, nbytes: float) -> float:
        return 0.0 if self.zero_copy else nbytes / self.link_bytes_per_s

    def seconds_out(self, nbytes: float) -> float:
        if self.zero_copy:
            return 0.0
        return nbytes / (self.link_out_bytes_per_s or self.link_bytes_per_s)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- prediction

@dataclass
class Prediction:
    """A relay step, predicted. Times in seconds, memory in bytes."""

    config: dict
    dtype_bytes: int
    params: int
    layer_params: list[int]
    tokens: int
    flops: float                 # model FLOPs of one step, recompute included
    step_s: float
    compute_s: float             # device busy computing (forward + post + backward)
    forward_s: float
    post_s: float
    backward_s: float
    transfer_s: float            # link busy with weights in and gradients out
    transfer_exposed_s: float    # what the transfers add to the step
    transfer_hidden_share: float  # 1 - exposed / total (1.0 when nothing moves)
    stash_transfer_s: float      # --stash host on a real link: synchronous, never hidden
    eps_update_s: float          # the EPS worker's busy time per step
    eps_exposed_s: float         # what the EPS adds to the step
    device_weight_bytes: int     # weights + gradient buffers at their peak
    device_ledger_bytes: int     # what the relay's ledger peaks at (device_peak_bytes on the CPU)
    activation_bytes: int        # rough: one layer's recompute over one micro-batch
    device_total_bytes: int      # ledger + activations
    host_eps_bytes: int          # EPS state: p, m, v, device copy, gradient inbox
    host_stash_bytes: int        # --stash host: the stashed boundaries
    host_total_bytes: int
    rates: dict
    layers_detail: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.step_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["achieved_flops_per_s"] = self.achieved_flops_per_s
        return d

    def summary(self) -> str:
        """One line, to print beside measured figures."""
        return (f"predicted: step {self.step_s:.3f} s ({self.tokens_per_s:,.0f} tok/s; compute {self.compute_s:.3f} s, "
                f"transfer exposed {self.transfer_exposed_s:.3f} s, EPS exposed {self.eps_exposed_s:.3f} s), "
                f"device {_mib(self.device_total_bytes)} (ledger {_mib(self.device_ledger_bytes)}, "
                f"weights {_mib(self.device_weight_bytes)}), host {_mib(self.host_total_bytes)}")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


@dataclass
class _Pass:
    layer: int
    kind: str            # "fwd" | "post" | "bwd"
    compute_s: float
    weights_in_s: float  # this pass's weight fetch over the link
    grad_out_s: float    # its gradient's way back (post and bwd)
    eps_s: float         # its layer's update (post and bwd)


def _schedule(cfg: TrainConfig, shapes: Sequence[LayerShape], rates: Rates, db: int) -> list[_Pass]:
    """The relay's passes in order, with their compute and link times (engine.train_step)."""
    m = cfg.micro_batches
    b = cfg.batch_size // m
    rate = rates.flops_per_s * rates.efficiency
    act = b * cfg.seq_len * cfg.d_model * db  # one micro-batch's boundary tensor
    last = len(shapes) - 1
    stash_moves = not rates.zero_copy and cfg.stash == "host"

    def compute(shape: LayerShape, kind: str) -> float:
        # per micro-batch: the FLOPs at the achieved rate, plus the fixed cost of a
        # call, counted like the FLOPs (a recompute + backward call is 3 forward calls)
        calls = 1 if kind == "fwd" else 3
        return m * (shape.pass_flops(kind, b, cfg.seq_len, cfg.d_model) / rate + calls * rates.per_call_s)

    def stash_s(n_out: int, n_in: int) -> float:
        # --stash host copies each boundary synchronously, on the compute stream
        return m * (rates.seconds_out(n_out * act) + rates.seconds_in(n_in * act)) if stash_moves else 0.0

    passes = []
    for i in range(last):  # forward: put act(i+1) (out); get act(i) (in) for i >= 1
        passes.append(_Pass(i, "fwd", compute(shapes[i], "fwd") + stash_s(1, 1 if i else 0),
                            rates.seconds_in(shapes[i].params * db), 0.0, 0.0))
    # post: pop act(last) (in), put grad(last) (out); forward and backward at once
    s = shapes[last]
    passes.append(_Pass(last, "post", compute(s, "post") + stash_s(1, 1), rates.seconds_in(s.params * db),
                        rates.seconds_out(s.params * db), s.params / rates.eps_elems_per_s))
    for i in range(last - 1, -1, -1):  # backward: pop act(i), pop grad(i+1) (in); put grad(i) (out)
        s = shapes[i]
        passes.append(_Pass(i, "bwd", compute(s, "bwd") + stash_s(1 if i else 0, 2 if i else 1),
                            rates.seconds_in(s.params * db), rates.seconds_out(s.params * db),
                            s.params / rates.eps_elems_per_s))
    return passes


def _simulate(passes: list[_Pass]) -> dict:
    """Replay one steady-state step on four timelines: the copy stream (weights in),
    the compute stream, the gradient stream (out) and the EPS worker.

    The relay fetches pass p's weights right after fetching pass p-1's, so the
    copy waits for the compute queued before pass p-1 (the double buffer):
    ``copy_p`` starts at ``max(copy_{p-1} end, compute_{p-2} end)``. A pass
    computes once its weights are in and the previous pass is done. A gradient
    goes out after its pass, one at a time; the EPS updates a layer once its
    gradient is out, one layer at a time, in order. The step ends when the
    device is done and the EPS has finished layer 0 (the next step's first
    fetch waits for it).
    """
    copy_end = comp_end = out_end = eps_end = 0.0
    comp_ends: list[float] = []
    for p, ps in enumerate(passes):
        issued_after = comp_ends[p - 2] if p >= 2 else 0.0
        copy_end = max(copy_end, issued_after) + ps.weights_in_s
        comp_end = max(comp_end, copy_end) + ps.compute_s
        comp_ends.append(comp_end)
        if ps.kind != "fwd":
            out_end = max(out_end, comp_end) + ps.grad_out_s
            eps_end = max(eps_end, out_end) + ps.eps_s
    device_end = max(comp_end, out_end)
    return {"device_end": device_end, "eps_end": eps_end, "step": max(device_end, eps_end)}


def _ledger(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int) -> dict:
    """Replay the relay's ledger calls (engine.train_step, stash.BoundaryStore) and
    return its peaks: the device bytes the relay holds across layer boundaries.
    On the CPU device this is exactly ``device_peak_bytes``."""
    m = cfg.micro_batches
    act = (cfg.batch_size // m) * cfg.seq_len * cfg.d_model * db
    stash_kind = "stash" if cfg.stash == "device" else "host_stash"
    cur = {"weights": 0, "grads": 0, "boundary": 0, "stash": 0, "host_stash": 0}
    peak = {"device": 0, "weights": 0, "host_stash": 0}

    def add(kind: str, n: int) -> None:
        cur[kind] += n
        peak["device"] = max(peak["device"], sum(v for k, v in cur.items() if k != "host_stash"))
        peak["weights"] = max(peak["weights"], cur["weights"] + cur["grads"])
        peak["host_stash"] = max(peak["host_stash"], cur["host_stash"])

    def sub(kind: str, n: int) -> None:
        cur[kind] -= n

    last = len(shapes) - 1
    for i in range(last):
        add("weights", shapes[i].params * db)
        for _ in range(m):
            held = 0
            if i:
                held = act
                add("boundary", act)
            add(stash_kind, act)
            sub("boundary", held)
        sub("weights", shapes[i].params * db)
    for i in range(last, -1, -1):
        n = shapes[i].params * db
        add("weights", n)
        add("grads", n)
        for _ in range(m):
            if i == last:
                sub(stash_kind, act)
                add("boundary", act)
                add(stash_kind, act)
                sub("boundary", act)
                continue
            if i:
                sub(stash_kind, act)
            sub(stash_kind, act)
            add("boundary", act)
            if i:
                add("boundary", act)
                add(stash_kind, act)
            sub("boundary", act * (2 if i else 1))
        sub("weights", n)
        sub("grads", n)
    assert cur["stash"] == 0 and cur["host_stash"] == 0 and cur["boundary"] == 0
    return peak


def _weights_peak_prefetch(shapes: Sequence[LayerShape], db: int) -> int:
    """Weights + gradients at their peak on CUDA, where the next pass's weights are
    already arriving: forward ``w_i + w_{i+1}``, post and backward ``w_i + g_i + w_next``."""
    n = [s.params * db for s in shapes]
    last = len(n) - 1
    peak = max(n[i] + n[i + 1] for i in range(last))
    order = list(range(last, -1, -1))
    for k, i in enumerate(order):
        nxt = n[order[k + 1]] if k + 1 < len(order) else 0
        peak = max(peak, 2 * n[i] + nxt)
    return peak


def activation_bytes(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int) -> int:
    """Rough transient bytes of one layer's recompute + backward over one micro-batch.

    A block saves about ``16 * t * d`` elements for backward (measured with
    ``saved_tensors_hooks`` on the built-in block at dropout 0: inputs of the two
    norms and four linears, the qkv and MLP-hidden outputs, SDPA's output) and
    its backward holds about ``8 * t * d`` more at once (the MLP hidden's
    gradients); with dropout the masks and the math-path attention
    probabilities add about ``4 * t * d + 2 * b * h * T^2``. The post stage
    saves its log-probabilities and norm input, ``(V + 2d) * t``, and its
    backward the logits' gradient, ``V * t``. The estimate is the larger of the
    two, in the compute dtype. It is not in the ledger (see README).
    """
    b = cfg.batch_size // cfg.micro_batches
    t, d = b * cfg.seq_len, cfg.d_model
    block = 24 * t * d
    if cfg.dropout > 0:
        block += 4 * t * d + 2 * b * cfg.heads * cfg.seq_len ** 2
    post = shapes[-1]
    vocab = max(post.matmul_params // d, 1)
    return max(block, (2 * vocab + 2 * d) * t) * db


def _timing(cfg: TrainConfig, shapes: Sequence[LayerShape], rates: Rates, db: int) -> dict:
    """The step on the link's timelines, and again with a free link: what the transfers add."""
    passes = _schedule(cfg, shapes, rates, db)
    timed = _simulate(passes)
    no_link = _simulate([replace(p, weights_in_s=0.0, grad_out_s=0.0) for p in passes])
    transfer_s = sum(p.weights_in_s + p.grad_out_s for p in passes)
    exposed = max(0.0, timed["device_end"] - no_link["device_end"])
    return {"passes": passes, "timed": timed, "transfer_s": transfer_s, "transfer_exposed_s": exposed,
            "hidden_share": 1.0 if transfer_s == 0 else max(0.0, 1.0 - exposed / transfer_s)}


def predict(cfg: TrainConfig, rates: Rates, *, dtype_bytes: int | None = None) -> Prediction:
    """Predict one steady-state relay step of ``cfg`` on a machine with ``rates``."""
    if cfg.batch_size % cfg.micro_batches:
        raise UserError(f"--micro-batches {cfg.micro_batches} does not divide --batch-size {cfg.batch_size}")
    db = dtype_bytes_of(cfg, dtype_bytes)
    shapes = layer_shapes(cfg)
    m, b = cfg.micro_batches, cfg.batch_size // cfg.micro_batches
    timing = _timing(cfg, shapes, rates, db)
    passes, timed, transfer_s = timing["passes"], timing["timed"], timing["transfer_s"]
    compute_s = sum(p.compute_s for p in passes)
    act_bytes = activation_bytes(cfg, shapes, db)
    ledger = _ledger(cfg, shapes, db)
    on_cuda = not rates.zero_copy
    weights = _weights_peak_prefetch(shapes, db) if on_cuda else ledger["weights"]
    # the ledger counts weights at fetch; with prefetch the next layer's are also resident
    device_ledger = ledger["device"] + (weights - ledger["weights"])
    params = sum(s.params for s in shapes)
    host_eps = params * (EPS_STATE_BYTES + 2 * db)
    exposed_transfer = timing["transfer_exposed_s"]
    flops = 0.0
    for p in passes:
        flops += m * shapes[p.layer].pass_flops(p.kind, b, cfg.seq_len, cfg.d_model)
    stash_s = 0.0
    if on_cuda and cfg.stash == "host":
        # the per-pass stash copies are inside compute_s; separate them for the report
        pure = _schedule(replace(cfg, stash="device"), shapes, rates, db)
        stash_s = compute_s - sum(p.compute_s for p in pure)
    detail = [{"layer": s.name, "params": s.params, "forward_flops": m * s.forward_flops(b, cfg.seq_len, cfg.d_model),
               "forward_s": next((p.compute_s for p in passes if p.layer == i and p.kind in ("fwd",)), 0.0),
               "backward_s": next(p.compute_s for p in passes if p.layer == i and p.kind in ("post", "bwd")),
               "weights_in_s": passes[i].weights_in_s, "eps_s": s.params / rates.eps_elems_per_s}
              for i, s in enumerate(shapes)]
    return Prediction(
        config={k: getattr(cfg, k) for k in ("model", "layers", "d_model", "heads", "seq_len", "batch_size",
                                             "micro_batches", "stash")},
        dtype_bytes=db, params=params, layer_params=[s.params for s in shapes],
        tokens=cfg.batch_size * cfg.seq_len, flops=flops,
        step_s=timed["step"], compute_s=compute_s,
        forward_s=sum(p.compute_s for p in passes if p.kind == "fwd"),
        post_s=sum(p.compute_s for p in passes if p.kind == "post"),
        backward_s=sum(p.compute_s for p in passes if p.kind == "bwd"),
        transfer_s=transfer_s, transfer_exposed_s=exposed_transfer,
        transfer_hidden_share=timing["hidden_share"],
        stash_transfer_s=stash_s,
        eps_update_s=sum(p.eps_s for p in passes),
        eps_exposed_s=max(0.0, timed["eps_end"] - timed["device_end"]),
        device_weight_bytes=weights, device_ledger_bytes=device_ledger,
        activation_bytes=act_bytes, device_total_bytes=device_ledger + act_bytes,
        host_eps_bytes=host_eps, host_stash_bytes=ledger["host_stash"],
        host_total_bytes=host_eps + ledger["host_stash"],
        rates=rates.to_dict(), layers_detail=detail)


# ---------------------------------------------------------------- choosing M

@dataclass
class MicroBatchChoice:
    micro_batches: int | None      # smallest M dividing the batch that hides the transfers (and fits)
    reason: str
    candidates: list[dict]         # per divisor M: step, hidden share, exposed share, device bytes, fits
    min_batch_to_hide: int | None  # smallest global batch (in sequences) that would hide them


def _exposed_share(timing: dict) -> float:
    """Share of the step spent waiting on the link."""
    return timing["transfer_exposed_s"] / timing["timed"]["step"] if timing["timed"]["step"] > 0 else 0.0


def choose_micro_batches(cfg: TrainConfig, rates: Rates, *, device_memory_bytes: int | None = None,
                         max_exposed: float = 0.05, dtype_bytes: int | None = None) -> MicroBatchChoice:
    """The smallest M dividing ``cfg.batch_size`` whose predicted step hides the
    transfers -- waits on the link for at most ``max_exposed`` of the step -- and,
    given a budget, fits the device.

    M does not change the compute per layer fetch (the batch is the same), so
    whether the transfers hide is decided by the batch, not by M: a layer's
    compute over B sequences against its weights' transfer. What M changes is
    device memory (the stash and one micro-batch's activations) and, a little,
    the compute rate (smaller GEMMs, more calls). When no M hides the
    transfers, ``min_batch_to_hide`` is the smallest global batch, as micro-
    batches of the size the smallest fitting M gives, that would: the paper's
    view, more micro-batches per layer fetch. (The first layer's fetch and the
    last gradients are exposed whatever the batch; the share shrinks as the
    step grows.)
    """
    db = dtype_bytes_of(cfg, dtype_bytes)
    shapes = layer_shapes(cfg)
    rows = []
    for m in _divisors(cfg.batch_size):
        p = predict(replace(cfg, micro_batches=m), rates, dtype_bytes=db)
        fits = device_memory_bytes is None or p.device_total_bytes <= device_memory_bytes
        rows.append({"micro_batches": m, "step_s": p.step_s, "hidden_share": p.transfer_hidden_share,
                     "exposed_share": p.transfer_exposed_s / p.step_s, "transfer_exposed_s": p.transfer_exposed_s,
                     "device_total_bytes": p.device_total_bytes, "fits": fits})
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return MicroBatchChoice(None, "no micro-batch count fits the device memory budget", rows, None)
    if rates.zero_copy:
        return MicroBatchChoice(fitting[0]["micro_batches"], "zero-copy device, nothing to hide: "
                                "the smallest M" + (" that fits" if device_memory_bytes else ""), rows, None)
    for r in fitting:
        if r["exposed_share"] <= max_exposed:
            return MicroBatchChoice(r["micro_batches"], "the smallest M" + (" that fits and" if device_memory_bytes
                                    else " that") + f" waits on the link for <= {max_exposed:.0%} of the step",
                                    rows, None)
    m0 = fitting[0]["micro_batches"]
    per = cfg.batch_size // m0

    def hides(k: int) -> bool:  # k micro-batches of ``per`` sequences per step
        return _exposed_share(_timing(replace(cfg, batch_size=k * per, micro_batches=k), shapes, rates, db)) \
            <= max_exposed

    need, lo, hi = None, m0, 2 * m0
    while hi <= 1 << 24 and not hides(hi):  # the exposed share falls as the compute per fetch grows
        lo, hi = hi, hi * 2
    if hi <= 1 << 24:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hides(mid) else (mid, hi)
        need = hi * per
    why = (f"no M hides the link at batch {cfg.batch_size} (waits > {max_exposed:.0%} of the step): a layer's "
           "compute is shorter than its transfer" +
           (f"; a batch of {need} sequences ({need // per} micro-batches of {per}) would" if need
            else "; no batch would (the link is too slow)"))
    return MicroBatchChoice(None, why, rows, need)


# ---------------------------------------------------------------- measuring

def _median_time(fn, repeats: int, sync=None) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(device: torch.device, tokens: int, d_model: int, *, dtype=torch.float32,
                   repeats: int = 5, min_time_s: float = 0.02) -> float:
    """FLOP/s of ``(tokens x d) @ (d x 4d)``, the shape of a block's MLP at one micro-batch."""
    a = torch.randn(tokens, d_model, device=device, dtype=dtype)
    w = torch.randn(4 * d_model, d_model, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    torch.nn.functional.linear(a, w)
    one = max(_median_time(lambda: torch.nn.functional.linear(a, w), 2, sync), 1e-7)
    inner = max(1, int(min_time_s / one))

    def run():
        for _ in range(inner):
            torch.nn.functional.linear(a, w)
    return 2.0 * tokens * d_model * 4 * d_model * inner / _median_time(run, repeats, sync)


def measure_link(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float | None, float | None]:
    """(host->device, device->host) bytes/s of pinned copies; (None, None) on the CPU (zero-copy)."""
    if device.type != "cuda":
        return None, None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    def sync():
        torch.cuda.synchronize(device)
    dev.copy_(host, non_blocking=True)
    host.copy_(dev, non_blocking=True)
    h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return nbytes / h2d, nbytes / d2h


def measure_eps(name: str = "numpy", numel: int = 4 << 20, repeats: int = 3, **options) -> float:
    """Elements/s of one EPS layer update (reduce one fp32 gradient, AdamW, fp32 copy)."""
    import numpy as np

    from .eps import AdamWHyper, StepScalars, make_backend
    backend = make_backend(name, **options)
    try:
        rng = np.random.default_rng(0)
        backend.allocate(0, rng.standard_normal(numel, dtype=np.float32))
        grads = (rng.standard_normal((1, numel), dtype=np.float32) * np.float32(1e-3))
        copy = np.empty(numel, np.float32)
        step = iter(range(1, 1 << 30))
        hyper = AdamWHyper()

        def run():
            backend.step(0, grads, StepScalars.compute(hyper, next(step), divisor=1.0), copy)
        run()
        return numel / _median_time(run, repeats)
    finally:
        backend.close()


def synthetic_batch(cfg: TrainConfig, seed: int = 0):
    """A batch of random byte tokens in ``cfg``'s shape, for timing (no corpus needed)."""
    from .data import Batch
    from .models.config import BYTE_VOCAB
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BYTE_VOCAB, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def time_relay_step(cfg: TrainConfig, device: torch.device | str = "cpu", *, steps: int = 3,
                    warmup: int = 1) -> float:
    """Median seconds of ``steps`` real relay steps of ``cfg`` (after ``warmup``), on
    random tokens, timed as ``l2l bench relay`` times them."""
    return time_relay_steps([cfg], device, steps=steps, warmup=warmup)[0]


def time_relay_steps(cfgs: Sequence[TrainConfig], device: torch.device | str = "cpu", *, steps: int = 3,
                     warmup: int = 1) -> list[float]:
    """Median step seconds of each of ``cfgs``' relays, built together and stepped in
    turn, so that drift in the machine's speed falls on all of them alike."""
    from .models import build_stack
    from .train import build_engine
    device = torch.device(device)
    cfgs = [replace(c, engine="l2l", device=device.type) for c in cfgs]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    engines = []
    try:
        for c in cfgs:
            engines.append(build_engine(c, build_stack(c.model_config(), c.seed), device))
        batches = [synthetic_batch(c) for c in cfgs]
        times: list[list[float]] = [[] for _ in cfgs]
        for step in range(warmup + steps):
            for k, engine in enumerate(engines):
                if sync:
                    sync()
                t0 = time.perf_counter()
                engine.train_step(batches[k], step)
                if sync:
                    sync()
                if step >= warmup:
                    times[k].append(time.perf_counter() - t0)
        return [statistics.median(t) for t in times]
    finally:
        for engine in engines:
            engine.close()


def _fit_terms(cfg: TrainConfig, rates: Rates, db: int | None) -> tuple[float, float, float]:
    """(compute seconds at efficiency 1 and no per-call cost, per-call units, the rest of
    the step: exposed transfers and EPS) of ``cfg``'s predicted step."""
    base = replace(rates, efficiency=1.0, per_call_s=0.0)
    p = predict(cfg, base, dtype_bytes=db)
    units = cfg.micro_batches * sum(1 if kind == "fwd" else 3 for kind in _pass_kinds(len(p.layer_params)))
    return p.compute_s - p.stash_transfer_s, units, p.step_s - p.compute_s + p.stash_transfer_s


def _pass_kinds(n_layers: int) -> list[str]:
    return ["fwd"] * (n_layers - 1) + ["post"] + ["bwd"] * (n_layers - 1)


def _divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def calibrate(cfg: TrainConfig, rates: Rates, device: torch.device | str = "cpu", *, layers: int = 4,
              micro_batches: Sequence[int] | None = None, steps: int = 5, warmup: int = 1,
              dtype_bytes: int | None = None) -> Rates:
    """Fit ``rates.efficiency`` and ``rates.per_call_s`` to real relay steps.

    Times ``steps`` relay steps (median, after ``warmup``) of ``cfg`` cut to
    ``layers`` blocks, at each of ``micro_batches`` (default: 1 and the largest
    divisor of the batch up to 8), the engines stepped in turn, and solves by
    least squares over those points ``measured - (exposed transfers and EPS) =
    A / efficiency + N * per_call_s``, where ``A`` is the step's compute at the
    matmul rate and ``N`` counts its calls (a forward call 1, a recompute +
    backward call 3, per layer per micro-batch). Two micro-batch counts
    separate the two: the FLOPs stay, the calls multiply. If the fit gives a
    negative per-call cost (noise, or one point), the per-call cost is 0 and
    the efficiency is fitted alone. The efficiency is relative to the measured
    matmul rate, so for models of the calibrated shape an error in that rate
    cancels.
    """
    small = replace(cfg, layers=max(1, min(cfg.layers, layers)))
    ms = list(micro_batches) if micro_batches else sorted({1, max(m for m in _divisors(cfg.batch_size) if m <= 8)})
    cfgs = [replace(small, micro_batches=m) for m in ms]
    measured = time_relay_steps(cfgs, device, steps=steps, warmup=warmup)
    fitted = fit_calibration(rates, list(zip(cfgs, measured)), dtype_bytes=dtype_bytes)
    notes = dict(fitted.notes)
    notes["calibration"] = {**notes["calibration"], "model": small.model, "layers": small.layers,
                            "d_model": small.d_model, "seq_len": small.seq_len, "batch_size": small.batch_size,
                            "steps": steps}
    return replace(fitted, notes=notes)


def fit_calibration(rates: Rates, timed: Sequence[tuple[TrainConfig, float]], *,
                    dtype_bytes: int | None = None) -> Rates:
    """``rates`` with ``efficiency`` and ``per_call_s`` fitted to relay steps already
    timed: ``(config, seconds)`` pairs (see :func:`calibrate`)."""
    points = []
    for c, measured in timed:
        a, n, rest = _fit_terms(c, rates, dtype_bytes)
        points.append({"micro_batches": c.micro_batches, "measured_s": measured, "a": a, "n": n,
                       "y": max(measured - rest, 1e-9)})
    inv_e, per_call = _least_squares(points)
    if per_call < 0 or inv_e <= 0:
        per_call = 0.0
        inv_e = sum(p["y"] * p["a"] for p in points) / sum(p["a"] ** 2 for p in points)
    notes = dict(rates.notes)
    notes["calibration"] = {"points": [{"layers": c.layers, "micro_batches": c.micro_batches, "measured_s": t}
                                       for c, t in timed]}
    return replace(rates, efficiency=1.0 / inv_e, per_call_s=per_call, notes=notes)


def _least_squares(points: list[dict]) -> tuple[float, float]:
    """(1/efficiency, per_call_s) minimising the relative error of ``y = a x + n c``."""
    if len(points) < 2:
        p = points[0]
        return p["y"] / p["a"], 0.0
    # weight each point by 1/y: every configuration counts alike, whatever its length
    saa = sum((p["a"] / p["y"]) ** 2 for p in points)
    snn = sum((p["n"] / p["y"]) ** 2 for p in points)
    san = sum(p["a"] * p["n"] / p["y"] ** 2 for p in points)
    say = sum(p["a"] / p["y"] for p in points)
    sny = sum(p["n"] / p["y"] for p in points)
    det = saa * snn - san * san
    if abs(det) < 1e-12 * saa * snn:
        return say / saa, 0.0
    return (say * snn - sny * san) / det, (saa * sny - san * say) / det


def measure_rates(device: torch.device | str = "cpu", cfg: TrainConfig | None = None, *, eps: str | None = None,
                  eps_options: dict | None = None, calibrate_steps: bool = True, layers: int = 4,
                  steps: int = 5, dtype_bytes: int | None = None) -> Rates:
    """The rates of this machine for ``cfg`` (default: the default TrainConfig).

    * compute: FLOP/s of a ``(b*T x d) @ (d x 4d)`` matmul (b = B/M sequences:
      one micro-batch through a block's MLP), median of 5, with torch's threads
      as they are set now;
    * link: pinned host<->device copies of 64 MiB on CUDA; None on the CPU
      (zero-copy);
    * EPS: one update of a 4M-element layer with ``cfg.eps``'s backend;
    * efficiency and per-call cost: :func:`calibrate`, ``steps`` relay steps of
      ``cfg`` cut to ``layers`` blocks at M = 1 and 8 (about 6 s for the bench's
      d 256 shape on this project's CPU); with ``calibrate_steps`` False,
      efficiency 1 and no per-call cost: the pure-FLOP model.
    """
    device = torch.device(device)
    cfg = cfg or TrainConfig()
    db = dtype_bytes_of(cfg, dtype_bytes)
    dtype = {4: torch.float32, 2: torch.bfloat16 if getattr(cfg, "precision", "") != "fp16" else torch.float16,
             8: torch.float64}.get(db, torch.float32)
    flops = measure_matmul(device, (cfg.batch_size // cfg.micro_batches) * cfg.seq_len, cfg.d_model, dtype=dtype)
    link_in, link_out = measure_link(device)
    name = eps or cfg.eps
    eps_rate = measure_eps(name, **(eps_options if eps_options is not None else cfg.eps_options()))
    notes = {"device": str(device), "torch_threads": torch.get_num_threads(), "eps_backend": name,
             "measured": ["compute", "link", "eps"]}
    rates = Rates(flops_per_s=flops, link_bytes_per_s=link_in, link_out_bytes_per_s=link_out,
                  eps_elems_per_s=eps_rate, device=device.type, notes=notes)
    if calibrate_steps:
        rates = calibrate(cfg, rates, device, layers=layers, steps=steps, dtype_bytes=dtype_bytes)
    return rates


# ---------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    from .cli import _Parser
    d = TrainConfig()
    p = _Parser(prog="l2l plan", description="Predict a relay step's time and memory from the model's shape and "
                "the machine's rates (measured here unless given).")
    p.add_argument("--model", default=d.model)
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--stash", default=d.stash)
    p.add_argument("--precision", default=None, help="fp32 | bf16 | fp16: sets the bytes per element (default fp32)")
    p.add_argument("--dtype-bytes", type=int, default=None, help="bytes per weight/gradient/activation element")
    p.add_argument("--device", default="auto", help="where to measure the rates: auto | cpu | cuda")
    p.add_argument("--eps", default=d.eps, help="EPS backend to measure (default %(default)s)")
    p.add_argument("--flops", type=float, default=None, help="device compute rate, FLOP/s (default: measured)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="host<->device bandwidth, GB/s (default: measured; 0 or inf: zero-copy)")
    p.add_argument("--eps-rate", type=float, default=None, help="EPS update rate, elements/s (default: measured)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="achieved share of --flops (default: calibrated with real relay steps when measuring, else 1)")
    p.add_argument("--per-call-us", type=float, default=None,
                   help="fixed cost of one layer's forward call on one micro-batch, µs (default: calibrated, else 0)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the relay steps that calibrate the efficiency")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="device memory for choosing M")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _config_of(args) -> TrainConfig:
    from dataclasses import fields
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(model=args.model, layers=args.layers, d_model=args.d_model, heads=args.heads,
                      seq_len=args.seq_len, dropout=args.dropout, batch_size=args.batch_size,
                      micro_batches=args.micro_batches, stash=args.stash, eps=args.eps, progress=False)
    if args.precision is not None:
        if args.precision not in DTYPE_BYTES:
            raise UserError(f"unknown precision {args.precision!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if "precision" in names:
            cfg = replace(cfg, precision=args.precision)
    return cfg.check()


def _rates_of(args, cfg: TrainConfig, dtype_bytes: int) -> Rates:
    given_link = args.link_gbps is not None
    link = None if not given_link or args.link_gbps == 0 or math.isinf(args.link_gbps) else args.link_gbps * 1e9
    if args.flops is not None and args.eps_rate is not None and given_link:
        rates = Rates(flops_per_s=args.flops, link_bytes_per_s=link, eps_elems_per_s=args.eps_rate,
                      device="cpu" if link is None else "cuda", notes={"measured": []})
    else:
        from .train import resolve_device
        device = resolve_device(args.device)
        rates = measure_rates(device, cfg, calibrate_steps=False, dtype_bytes=dtype_bytes)
        given = {"link": given_link, "eps": args.eps_rate is not None, "compute": args.flops is not None}
        rates = replace(rates, notes={**rates.notes, "measured": [k for k in rates.notes["measured"]
                                                                  if not given[k]]})
        if given_link:
            rates = replace(rates, link_bytes_per_s=link, link_out_bytes_per_s=None,
                            device="cpu" if link is None else "cuda")
        if args.eps_rate is not None:
            rates = replace(rates, eps_elems_per_s=args.eps_rate)
        if args.flops is not None:
            rates = replace(rates, flops_per_s=args.flops)
        elif not args.no_calibrate and args.efficiency is None and args.per_call_us is None:
            rates = calibrate(cfg, rates, device, dtype_bytes=dtype_bytes)
    if args.efficiency is not None:
        rates = replace(rates, efficiency=args.efficiency)
    if args.per_call_us is not None:
        rates = replace(rates, per_call_s=args.per_call_us * 1e-6)
    return rates


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def format_plan(p: Prediction, rates: Rates, choice: MicroBatchChoice | None = None) -> str:
    c = p.config
    b = c["batch_size"] // c["micro_batches"]
    lp = p.layer_params
    lines = [
        (f"l2l plan: {c['model']}, {c['layers']} blocks, d {c['d_model']}, {c['heads']} heads, seq {c['seq_len']}, "
         f"batch {c['batch_size']} as {c['micro_batches']} micro-batches of {b}, stash {c['stash']}, "
         f"{p.dtype_bytes} bytes/element"),
        f"parameters: {p.params:,} (pre {lp[0]:,}, block {max(lp[1:-1]):,}, post {lp[-1]:,})",
        "rates: compute " + _si(rates.flops_per_s, "FLOP/s") + f" matmul x {rates.efficiency:.2f} efficiency"
        + (f" + {rates.per_call_s * 1e6:.0f} µs per call" if rates.per_call_s else "")
        + ", link " + ("zero-copy" if rates.zero_copy else _si(rates.link_bytes_per_s, "B/s"))
        + ", EPS " + _si(rates.eps_elems_per_s, "elem/s")
        + (f"  (measured: {', '.join(rates.notes['measured'])}"
           + ("; calibrated on relay steps" if "calibration" in rates.notes else "") + ")"
           if rates.notes.get("measured") else ""),
        "",
        f"{'step time':<26}{p.step_s:10.3f} s   {p.tokens_per_s:,.0f} tok/s, "
        + _si(p.flops, "FLOP") + " per step, " + _si(p.achieved_flops_per_s, "FLOP/s") + " achieved",
        (f"{'  compute':<26}{p.compute_s:10.3f} s   forward {p.forward_s:.3f}, post {p.post_s:.3f}, "
         f"recompute+backward {p.backward_s:.3f}"),
        f"{'  link (weights, grads)':<26}{p.transfer_s:10.3f} s   {p.transfer_hidden_share:.0%} hidden, "
        f"exposed {p.transfer_exposed_s:.3f} s" + ("" if not rates.zero_copy else " (zero-copy)"),
    ]
    if p.stash_transfer_s:
        lines.append(f"{'  host stash copies':<26}{p.stash_transfer_s:10.3f} s   synchronous (in compute)")
    lines += [
        f"{'  EPS updates':<26}{p.eps_update_s:10.3f} s   exposed {p.eps_exposed_s:.4f} s",
        "",
        f"{'device memory':<26}{_mib(p.device_total_bytes):>14}",
        f"{'  weights + gradients':<26}{_mib(p.device_weight_bytes):>14}",
        f"{'  ledger (weights, stash)':<26}{_mib(p.device_ledger_bytes):>14}   "
        + ("= device_peak_bytes on the CPU" if rates.zero_copy else "what the relay holds across layers"),
        f"{'  activations (rough)':<26}{_mib(p.activation_bytes):>14}   one layer's recompute, one micro-batch",
        f"{'host memory':<26}{_mib(p.host_total_bytes):>14}",
        f"{'  EPS state':<26}{_mib(p.host_eps_bytes):>14}   {12 + 2 * p.dtype_bytes} bytes/param",
    ]
    if p.host_stash_bytes:
        lines.append(f"{'  stash':<26}{_mib(p.host_stash_bytes):>14}")
    if choice is not None:
        lines += ["", f"micro-batches: {choice.micro_batches if choice.micro_batches else 'none'} -- {choice.reason}",
                  f"{'M':>5} {'step (s)':>9} {'hidden':>7} {'waits':>6} {'device':>12} {'fits':>5}"]
        for r in choice.candidates:
            lines.append(f"{r['micro_batches']:>5} {r['step_s']:>9.3f} {r['hidden_share']:>7.0%} {r['exposed_share']:>6.1%} "
                         f"{_mib(r['device_total_bytes']):>12} {'yes' if r['fits'] else 'no':>5}")
    return "\n".join(lines)


def run_plan(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = _config_of(args)
    db = dtype_bytes_of(cfg, args.dtype_bytes if args.dtype_bytes is not None
                        else DTYPE_BYTES.get(args.precision) if args.precision else None)
    rates = _rates_of(args, cfg, db)
    prediction = predict(cfg, rates, dtype_bytes=db)
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    choice = choose_micro_batches(cfg, rates, device_memory_bytes=budget, dtype_bytes=db)
    if args.json:
        print(json.dumps({"prediction": prediction.to_dict(), "rates": rates.to_dict(),
                          "micro_batches": asdict(choice)}, indent=2, default=str))
    else:
        print(format_plan(prediction, rates, choice))
    return 0
