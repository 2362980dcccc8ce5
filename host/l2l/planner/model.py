"""The model of a relay step: predict a relay step's time and memory before running it.

From the model's shape (a :class:`~l2l.config.TrainConfig`) and three rates of
the machine -- the device's compute rate (FLOP/s), the host<->device link
(bytes/s; the CPU device is zero-copy) and the EPS update rate (elements/s) --
:func:`predict` replays the relay's schedule (``relay/engine.py``) layer by
layer and returns a :class:`Prediction`: step time, how much of the weight and
gradient traffic hides under compute, how much of the EPS's work is exposed,
device memory (what the relay's ledger counts, plus a rough estimate of one
layer's transient activations) and host memory. :func:`~l2l.planner.measure.measure_rates` measures
the rates here; :func:`choose_micro_batches` picks M; ``command.py`` is ``l2l plan``.

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
* **Workers and machines** (:class:`Machines`). R machines under torchrun run M/R
  micro-batches each, split over K workers (:func:`serial_micro_batches`: K GPUs
  side by side, K CPU workers on shared cores). The sharded EPS updates 1/R of each
  layer after its gradients' exchange (on the EPS thread, at the network's rate) and
  gathers each fetch's whole copy from the owners on a thread of its own, at most
  ``GATHER_WINDOW`` layers ahead of the relay; what the gathers add to the step is
  ``gather_exposed_s``.

Accuracy on the project's 2-core CPU (torch 2.13, 2 threads, quiet machine),
gpt d 256, 4 heads, seq 128, batch 16, the ``l2l bench relay`` grid (2-16
blocks, M = 1, 2, 4, 8), rates measured and calibrated once on that shape:
within 3.3% (mean 1.4%) of the relay timed alone (median of 5 steps), within
14% (mean 5.5%) of ``l2l bench relay`` run in the same session, which steps
six engines in turn and so times each relay 1-13% slower than alone, the more
so the larger M.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from ..config import TrainConfig
from ..eps import shares_masters
from ..eps.gather import GATHER_WINDOW
from ..errors import UserError
from .lora import lora_sizes
from .shapes import INBOXES_IN_FLIGHT, eps_state_bytes, LayerShape, dtype_bytes_of, layer_shapes, with_model_shape

RUNTIME_BYTES = 240 << 20  # an idle process with torch 2.13 and l2l imported, this project's CPU machine

# ---------------------------------------------------------------- rates

def default_runtime_bytes() -> int:
    """The resident set this process noted as the ``l2l`` command started
    (:func:`~l2l.hostmem.record_runtime_resident`), else :data:`RUNTIME_BYTES`."""
    from ..hostmem import runtime_resident
    return runtime_resident() or RUNTIME_BYTES


@dataclass(frozen=True)
class Rates:
    """What the machine does per second, measured (:func:`measure_rates`) or given.

    ``flops_per_s`` is a dense matmul's rate. ``efficiency`` is the relay's
    achieved share of it and ``per_call_s`` its fixed cost per layer per
    micro-batch per forward call (a recompute + backward call counts 3), both
    fitted by :func:`calibrate`; given rates default to the pure-FLOP model
    (1 and 0). ``link_bytes_per_s`` is host->device, None for a zero-copy
    device (the CPU); ``link_out_bytes_per_s`` device->host, defaulting to it.
    ``runtime_bytes`` is what the process holds before it builds a model.
    """

    flops_per_s: float
    link_bytes_per_s: float | None = None
    eps_elems_per_s: float = 5e8
    efficiency: float = 1.0
    per_call_s: float = 0.0
    link_out_bytes_per_s: float | None = None
    device: str = "cpu"
    notes: dict = field(default_factory=dict, compare=False)
    # the resident set of a process that has imported torch and l2l and holds no model
    runtime_bytes: int = field(default_factory=default_runtime_bytes)

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


# ---------------------------------------------------------------- machines

@dataclass(frozen=True)
class Machines:
    """R machines under torchrun, each running the relay on its share of the batch with
    ``cfg.devices`` workers, and how their EPS is laid out (``--eps-layout``)."""

    count: int = 1
    network_bytes_per_s: float | None = None  # each machine's link, each way; None: free
    layout: str = "sharded"

    @property
    def sharded(self) -> bool:
        return self.count > 1 and self.layout == "sharded"

    def seconds(self, nbytes: float) -> float:
        return 0.0 if self.network_bytes_per_s is None else nbytes / self.network_bytes_per_s

    @classmethod
    def of(cls, cfg: TrainConfig, count: int, network_gbps: float | None = None) -> Machines:
        """``count`` machines of ``cfg``'s EPS layout (``l2l plan --machines``; ``l2l train``'s
        forecast under torchrun, whose network is not known: free)."""
        return cls(count, None if network_gbps is None else network_gbps * 1e9, cfg.eps_layout)


def copy_fetches(i: int, last: int, on_cuda: bool) -> int:
    """How often a training step fetches layer ``i``'s weights (``RelayEngine._train_route``):
    forward and backward, the post stage once; on CUDA the layer before the post stays on the
    device for the backward."""
    if i == last:
        return 1
    return 1 if on_cuda and i == last - 1 and i > 0 else 2


def _exchange_layer_bytes(cfg: TrainConfig, shape: LayerShape, db: int, machines: Machines) -> int:
    """One layer's gradients, all machines together: sharded, each machine's raw rows
    (``cfg.devices``, one per worker; a tied entry's once per using layer) to their owners,
    all but its own columns, ``K * p * db * (R - 1)`` whatever the slices; replicated, a ring
    all-reduce of the fp32 box sum, ``2 * p * 4 * (R - 1)``. Each machine sends 1/R of it."""
    r = machines.count
    if r <= 1:
        return 0
    return (cfg.devices * shape.params * db if machines.sharded else 2 * shape.params * 4) * (r - 1)


def _gather_fetch_bytes(shape: LayerShape, db: int, machines: Machines) -> int:
    """One fetch's gather of a layer's copy (sharded), all machines together: each owner's
    slice to the R - 1 others, ``p * db * (R - 1)``; each machine sends 1/R of it."""
    return shape.params * db * (machines.count - 1) if machines.sharded else 0


def collective_bytes(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int, machines: Machines,
                     on_cuda: bool = False) -> int:
    """Bytes all machines together send to each other in one step, to the EPS's collectives:
    the gradients (:func:`exchange_bytes`) and, sharded, each fetch's gather of a copy
    (:func:`gather_bytes`)."""
    return exchange_bytes(cfg, shapes, db, machines) + gather_bytes(cfg, shapes, db, machines, on_cuda)


def exchange_bytes(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int, machines: Machines) -> int:
    """Of :func:`collective_bytes`, the gradients' part (replicated: all of it)."""
    return sum(_exchange_layer_bytes(cfg, s, db, machines) for s in shapes)


def _gather_seconds(shape: LayerShape, db: int, machines: Machines) -> float:
    """One fetch's gather of a layer's device copy (sharded): R broadcasts, one from each
    owner of a slice; each machine receives all but its own, ``(R - 1) / R * n * db``."""
    return machines.seconds(_gather_fetch_bytes(shape, db, machines) / machines.count)


def gather_bytes(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int, machines: Machines,
                 on_cuda: bool = False) -> int:
    """Bytes all machines together send each other in one step to gather the sharded EPS's
    device copies: one gather per fetch of a layer (:func:`copy_fetches`: twice a step but
    the post stage's). The window (``GATHER_WINDOW`` entries) is too short to keep a
    forward's copy for the backward."""
    last = len(shapes) - 1
    return sum(copy_fetches(i, last, on_cuda) * _gather_fetch_bytes(s, db, machines) for i, s in enumerate(shapes))


def _collective_seconds(cfg: TrainConfig, shape: LayerShape, db: int, machines: Machines) -> float:
    """One layer's collectives on its EPS thread, the bytes this machine sends at its link's
    rate: the gradients' exchange (a sharded EPS gathers the copies on a thread of its own:
    :func:`_gather_seconds`)."""
    return machines.seconds(_exchange_layer_bytes(cfg, shape, db, machines) / machines.count)


def _eps_seconds(cfg: TrainConfig, shape: LayerShape, rates: Rates, db: int, machines: Machines) -> float:
    """One layer's time on its EPS thread: the update of this machine's part, and the collectives."""
    owned = shape.params / machines.count if machines.sharded else shape.params
    return owned / rates.eps_elems_per_s + _collective_seconds(cfg, shape, db, machines)


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
    device_total_bytes: int      # ledger + activations (+ on CUDA the backward's extra)
    host_eps_bytes: int          # EPS state: p, m, v, device copy; the inboxes in flight
    host_state_bytes: int        # of which p, the moments and the device copies: the byte budget's floor
    host_stash_bytes: int        # --stash host: the stashed boundaries
    host_runtime_bytes: int      # the process before any model: torch and l2l imported
    host_transient_bytes: int    # a few layers' worth: build, gradient temporaries, reduction;
    #                              on the CPU device also the device's own memory (stash, activations)
    host_total_bytes: int        # the process's peak resident set: the four above, and the gathered copies
    rates: dict
    machines: int = 1            # under torchrun: the host figures are each machine's
    eps_layout: str = "sharded"
    collective_bytes: int = 0    # all machines together send this to the EPS's collectives a step
    device_backward_extra_bytes: int = 0  # CUDA: the weight-gradient temporaries and cuBLAS workspaces
    eps_state_bytes: int = 12    # p and the optimizer's moments, bytes a parameter (AdamW: 12, Lion: 8)
    lora_adapter_params: int = 0  # LoRA: the parameters the EPS trains (0: all of them)
    lora_base_bytes: int = 0     # LoRA: the frozen base's store, within host_state_bytes
    #                              (the sharded EPS's books: gradients, and each updated copy once)
    exchange_bytes: int = 0      # of which the gradients' (sharded; replicated: all of it)
    collective_s: float = 0.0    # of the EPS's busy time, one machine's collectives (its gradients')
    gather_bytes: int = 0        # sharded: all machines together send this a step to gather the copies
    gather_s: float = 0.0        # one machine's gather thread, busy a step
    gather_exposed_s: float = 0.0  # what the gathers add to the step
    host_gather_bytes: int = 0   # sharded: the gathered copies' window, and those the workers hold
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



@dataclass
class _Pass:
    layer: int
    kind: str            # "fwd" | "post" | "bwd"
    compute_s: float
    weights_in_s: float  # this pass's weight fetch over the link
    grad_out_s: float    # its gradient's way back (post and bwd)
    eps_s: float         # its layer's update (post and bwd), collectives included
    net_s: float = 0.0   # of eps_s, the collectives: on the network
    gather_s: float = 0.0  # the sharded EPS: gathering the copy this pass fetches, on the network


def serial_micro_batches(cfg: TrainConfig, rates: Rates, machines: Machines = Machines()) -> int:
    """How many of a pass's micro-batches run one after another at ``rates.flops_per_s``.

    A machine runs ``M / R`` micro-batches of each pass, split over its K workers
    (``--devices``). On CUDA each worker has a GPU of its own and ``flops_per_s`` is one
    GPU's rate (``measure_matmul`` times one device; ``--flops`` gives one), so the K
    shares run side by side and a pass lasts one worker's ``M / (R * K)``. On the CPU the
    K workers are threads on the same cores, and ``flops_per_s`` was measured with torch's
    threads on all of them: it is the box's rate, which K workers share, not multiply.
    There a pass lasts the machine's ``M / R`` at that rate, as with one worker; how well
    K workers fill the cores (``l2l bench workers``: 1.28x for two on two cores) is in the
    efficiency that :func:`calibrate` fits on relay steps with ``cfg.devices`` workers."""
    m = cfg.micro_batches // machines.count
    return m if rates.zero_copy else m // cfg.devices  # zero-copy: the planner's CPU device


def pass_schedule(cfg: TrainConfig, shapes: Sequence[LayerShape], rates: Rates, db: int,
                  machines: Machines = Machines()) -> list[_Pass]:
    """The relay's passes in order, with their compute and link times (engine.train_step):
    the compute of :func:`serial_micro_batches`, the transfers of one worker (each GPU
    has a link of its own)."""
    m = serial_micro_batches(cfg, rates, machines)
    b = cfg.batch_size // cfg.micro_batches
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

    def network(s: LayerShape, gathered: bool = True) -> dict:
        return {"net_s": _collective_seconds(cfg, s, db, machines),
                "gather_s": _gather_seconds(s, db, machines) if gathered else 0.0}

    passes = []
    for i in range(last):  # forward: put act(i+1) (out); get act(i) (in) for i >= 1
        passes.append(_Pass(i, "fwd", compute(shapes[i], "fwd") + stash_s(1, 1 if i else 0),
                            rates.seconds_in(shapes[i].params * db), 0.0, 0.0,
                            gather_s=_gather_seconds(shapes[i], db, machines)))
    # post: pop act(last) (in), put grad(last) (out); forward and backward at once
    s = shapes[last]
    passes.append(_Pass(last, "post", compute(s, "post") + stash_s(1, 1), rates.seconds_in(s.params * db),
                        rates.seconds_out(s.params * db), _eps_seconds(cfg, s, rates, db, machines), **network(s)))
    for i in range(last - 1, -1, -1):  # backward: pop act(i), pop grad(i+1) (in); put grad(i) (out)
        s = shapes[i]
        passes.append(_Pass(i, "bwd", compute(s, "bwd") + stash_s(1 if i else 0, 2 if i else 1),
                            rates.seconds_in(s.params * db), rates.seconds_out(s.params * db),
                            _eps_seconds(cfg, s, rates, db, machines),
                            **network(s, gathered=copy_fetches(i, last, not rates.zero_copy) == 2)))
    return passes


def _simulate(passes: list[_Pass], window: int = GATHER_WINDOW) -> dict:
    """Replay one steady-state step on six timelines: the copy stream (weights in),
    the compute stream, the gradient stream (out), the EPS worker, the gather thread
    (the sharded EPS's copies) and the network.

    The relay fetches pass p's weights right after fetching pass p-1's, so the
    copy waits for the compute queued before pass p-1 (the double buffer):
    ``copy_p`` starts at ``max(copy_{p-1} end, compute_{p-2} end)``, and, sharded,
    once pass p's copy is gathered. A gather starts when the one before it is done
    and the window has room: at most ``window`` gathered copies wait for the relay,
    so pass p's starts once pass ``p - window``'s was fetched. A pass computes once
    its weights are in and the previous pass is done. A gradient goes out after its
    pass, one at a time; the EPS updates a layer once its gradient is out, one layer
    at a time, in order. The step ends when the device is done and the EPS has
    finished layer 0 (the next step's first fetch waits for it, and its gather too:
    the step's first gather is exposed whole). The gathers and the EPS's collectives
    share the machine's link, which no timeline here slows; the step is at least the
    sum of their network seconds, so a step bound by the network is not predicted short.
    """
    copy_end = comp_end = out_end = eps_end = gather_end = 0.0
    comp_ends: list[float] = []
    fetched: list[float] = []
    for p, ps in enumerate(passes):
        gather_end = max(gather_end, fetched[p - window] if p >= window else 0.0) + ps.gather_s
        issued_after = comp_ends[p - 2] if p >= 2 else 0.0
        fetched.append(max(copy_end, issued_after, gather_end))
        copy_end = fetched[p] + ps.weights_in_s
        comp_end = max(comp_end, copy_end) + ps.compute_s
        comp_ends.append(comp_end)
        if ps.kind != "fwd":
            out_end = max(out_end, comp_end) + ps.grad_out_s
            eps_end = max(eps_end, out_end) + ps.eps_s
    device_end = max(comp_end, out_end)
    network = sum(ps.net_s + ps.gather_s for ps in passes)
    return {"device_end": device_end, "eps_end": eps_end, "gather_end": gather_end, "network": network,
            "step": max(device_end, eps_end, network)}


def _ledger(cfg: TrainConfig, shapes: Sequence[LayerShape], db: int, machines: Machines = Machines()) -> dict:
    """Replay the relay's ledger calls (engine.train_step, stash.BoundaryStore) and
    return its peaks: the device bytes one worker holds across layer boundaries, over
    its ``M / (R * K)`` micro-batches. On the CPU device this is exactly
    ``device_peak_bytes`` (with K workers, their largest)."""
    m = cfg.micro_batches // (machines.count * cfg.devices)
    act = (cfg.batch_size // cfg.micro_batches) * cfg.seq_len * cfg.d_model * db
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


# cuBLAS's workspaces at the relay's device peak: one for the main thread (the forward and the
# recomputes) and one for autograd's device thread (the backward), each taken from the caching
# allocator. Measured on an H200 with torch 2.11 (bench/gpu_memory_peak.py, docs/results.md
# "On a GPU"): 65 MiB alive before a step, and a 128 MiB block with no Python frame at the peak.
CUDA_WORKSPACE_BYTES = 192 * 2**20


def device_backward_extra_bytes(largest: int, db: int) -> int:
    """CUDA device bytes a layer's backward holds beyond the ledger and the activations: the
    layer's weight gradients, all at once, in the compute dtype -- a tap adds each one into the
    gradient buffer only once the autograd engine reaches the tap, after every other node of the
    micro-batch's backward (taps are made before the ops that use them, and the engine runs the
    most recently made ready node first) -- and cuBLAS's workspaces. On the CPU the same
    temporaries are host memory (:func:`host_transient_bytes`)."""
    return largest * db + CUDA_WORKSPACE_BYTES


def device_copy_bytes(cfg: TrainConfig, db: int, on_cuda: bool) -> int:
    """Host bytes a parameter for the EPS's device copies: none where the CPU computes in fp32
    on the EPS's masters themselves (``EagerParamServer(share_masters=True)``: the NumPy EPS,
    the OpenCL EPS on a CPU device, :func:`~l2l.eps.shares_masters`), else one copy in the
    compute dtype."""
    if on_cuda or db != 4 or getattr(cfg, "eps_offload", None):
        return db
    choice = cfg.eps_choice()  # --eps auto resolved as the run resolves it
    shared = shares_masters(choice.name, **choice.options)
    return 0 if shared else db


def gathered_copy_bytes(cfg: TrainConfig, largest: int, db: int, on_cuda: bool) -> int:
    """Host bytes of the sharded EPS's whole copies, gathered from their owners: at most
    ``GATHER_WINDOW`` waiting for the relay, one each of the K workers computes with, and on
    CUDA one more a worker, the next layer's, on its way to the GPU. Each counted at the
    largest layer's size (its entries together: a tied embedding is gathered with it)."""
    return (GATHER_WINDOW + cfg.devices * (2 if on_cuda else 1)) * largest * db


def host_transient_bytes(cfg: TrainConfig, largest: int, db: int, ledger: dict, act_bytes: int,
                         on_cuda: bool) -> int:
    """Host memory beyond the EPS state that a few layers set, at the step's peak.

    Measured on the CPU with ``/proc/self/status`` at every layer boundary (GPT 16 x d1024,
    fp32 and bf16): building the EPS leaves one layer's fp32 initial weights with the
    allocator (4 bytes a parameter of the largest layer); a layer's backward makes its
    weight gradients before adding them to the inbox (about one layer in the compute
    dtype, per worker); the NumPy EPS reduces the contributions into one fp32 buffer
    of the largest layer before it updates (unless there is one contribution and no
    loss scale: then the inbox is the reduced gradient, widened a chunk at a time). On the CPU
    device the device's memory is host memory: each worker's stash and boundaries (its
    ledger, less the weights and gradients, which are the EPS's own arrays there) and one
    layer's activations, K times (the workers run at once)."""
    transient = largest * 4 + largest * db * cfg.devices
    if cfg.devices > 1 or cfg.precision == "fp16":  # fp16 has a loss scale: bf16 and fp32 one worker, none
        transient += largest * 4
    if not on_cuda:
        transient += cfg.devices * (ledger["device"] - ledger["weights"] + act_bytes)
    return transient


def _timing(cfg: TrainConfig, shapes: Sequence[LayerShape], rates: Rates, db: int,
            machines: Machines = Machines()) -> dict:
    """The step on the link's timelines, and again with a free link: what the transfers add;
    and again with free gathers: what the sharded EPS's gathers add."""
    passes = pass_schedule(cfg, shapes, rates, db, machines)
    timed = _simulate(passes)
    no_link = _simulate([replace(p, weights_in_s=0.0, grad_out_s=0.0) for p in passes])
    transfer_s = sum(p.weights_in_s + p.grad_out_s for p in passes)
    exposed = max(0.0, timed["device_end"] - no_link["device_end"])
    gather_s = sum(p.gather_s for p in passes)
    gather_exposed = 0.0
    if gather_s:
        gather_exposed = max(0.0, timed["step"] - _simulate([replace(p, gather_s=0.0) for p in passes])["step"])
    return {"passes": passes, "timed": timed, "transfer_s": transfer_s, "transfer_exposed_s": exposed,
            "hidden_share": 1.0 if transfer_s == 0 else max(0.0, 1.0 - exposed / transfer_s),
            "gather_s": gather_s, "gather_exposed_s": gather_exposed}


def predict(cfg: TrainConfig, rates: Rates, *, dtype_bytes: int | None = None,
            machines: Machines = Machines()) -> Prediction:
    """Predict one steady-state relay step of ``cfg`` on a machine with ``rates`` (on each of
    ``machines``: its host memory, and the step with the EPS's collectives)."""
    cfg = with_model_shape(cfg)
    if cfg.batch_size % cfg.micro_batches:
        raise UserError(f"--micro-batches {cfg.micro_batches} does not divide --batch-size {cfg.batch_size}")
    db = dtype_bytes_of(cfg, dtype_bytes)
    shapes = layer_shapes(cfg)
    if cfg.micro_batches % (machines.count * cfg.devices):
        raise UserError(f"--micro-batches {cfg.micro_batches} must be a multiple of machines x --devices "
                        f"({machines.count} x {cfg.devices})")
    m, b = cfg.micro_batches // machines.count, cfg.batch_size // cfg.micro_batches  # this machine's M
    timing = _timing(cfg, shapes, rates, db, machines)
    passes, timed, transfer_s = timing["passes"], timing["timed"], timing["transfer_s"]
    compute_s = sum(p.compute_s for p in passes)
    act_bytes = activation_bytes(cfg, shapes, db)
    ledger = _ledger(cfg, shapes, db, machines)
    on_cuda = not rates.zero_copy
    weights = _weights_peak_prefetch(shapes, db) if on_cuda else ledger["weights"]
    # the ledger counts weights at fetch; with prefetch the next layer's are also resident
    device_ledger = ledger["device"] + (weights - ledger["weights"])
    params = sum(s.params - s.counted_before for s in shapes)
    largest = max(s.params for s in shapes)
    # p, m, v and the device copy per parameter; gradient inboxes only for the layers in
    # flight: the one being accumulated and the one whose update is running (per worker)
    lora = lora_sizes(cfg, params, sum(s.kind == "block" for s in shapes))
    inboxes = INBOXES_IN_FLIGHT * (largest if lora is None else lora.largest_entry) * db * cfg.devices
    copy = device_copy_bytes(cfg, db, on_cuda)
    host_gather = 0
    state_bytes = eps_state_bytes(cfg)  # p and the optimizer's moments
    # LoRA: the EPS trains the adapters; the frozen base is a store of its own (planner/lora.py)
    trained, frozen = (params, 0) if lora is None else (lora.adapter_params, lora.base_bytes)
    if machines.sharded:  # 1/R of the state and of the copies (whole blocks: within a block of 1/R)
        host_state = math.ceil(trained * state_bytes / machines.count) + math.ceil(trained * copy / machines.count)
        host_gather = gathered_copy_bytes(cfg, largest, db, on_cuda)
    else:
        host_state = trained * (state_bytes + copy)
    host_state += frozen
    host_eps = host_state + inboxes
    host_stash = cfg.devices * ledger["host_stash"]  # --stash host: every worker's, in this machine's memory
    transient = host_transient_bytes(cfg, largest, db, ledger, act_bytes, on_cuda)
    if lora is not None:  # transformers and peft imported; the fetched layer's frozen weights cast
        transient += lora.import_bytes + lora.compute_copy_bytes(largest, db, on_cuda)
    if machines.sharded:  # the exchange's send and receive buffers of the largest layer
        transient += 2 * cfg.devices * largest * db
    exposed_transfer = timing["transfer_exposed_s"]
    backward_extra = device_backward_extra_bytes(largest, db) if on_cuda else 0
    flops = 0.0
    for p in passes:
        flops += m * shapes[p.layer].pass_flops(p.kind, b, cfg.seq_len, cfg.d_model)
    stash_s = 0.0
    if on_cuda and cfg.stash == "host":
        # the per-pass stash copies are inside compute_s; separate them for the report
        pure = pass_schedule(replace(cfg, stash="device"), shapes, rates, db, machines)
        stash_s = compute_s - sum(p.compute_s for p in pure)
    forward_s = {p.layer: p.compute_s for p in passes if p.kind == "fwd"}
    backward_s = {p.layer: p.compute_s for p in passes if p.kind in ("post", "bwd")}
    detail = [{"layer": s.name, "params": s.params, "forward_flops": m * s.forward_flops(b, cfg.seq_len, cfg.d_model),
               "forward_s": forward_s.get(i, 0.0), "backward_s": backward_s[i],
               "weights_in_s": passes[i].weights_in_s, "eps_s": _eps_seconds(cfg, s, rates, db, machines)}
              for i, s in enumerate(shapes)]
    return Prediction(
        config={k: getattr(cfg, k) for k in ("model", "layers", "d_model", "heads", "seq_len", "batch_size",
                                             "micro_batches", "stash", "devices")},
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
        activation_bytes=act_bytes,
        device_backward_extra_bytes=backward_extra,
        device_total_bytes=device_ledger + act_bytes + backward_extra,
        host_eps_bytes=host_eps, host_state_bytes=host_state, host_stash_bytes=host_stash, eps_state_bytes=state_bytes,
        lora_adapter_params=0 if lora is None else lora.adapter_params, lora_base_bytes=frozen,
        host_runtime_bytes=rates.runtime_bytes, host_transient_bytes=transient,
        host_gather_bytes=host_gather,
        host_total_bytes=rates.runtime_bytes + host_eps + host_stash + transient + host_gather,
        rates=rates.to_dict(), layers_detail=detail,
        machines=machines.count, eps_layout=machines.layout if machines.count > 1 else "",
        collective_bytes=collective_bytes(cfg, shapes, db, machines, on_cuda),
        exchange_bytes=exchange_bytes(cfg, shapes, db, machines),
        collective_s=sum(_collective_seconds(cfg, s, db, machines) for s in shapes),
        gather_bytes=gather_bytes(cfg, shapes, db, machines, on_cuda), gather_s=timing["gather_s"],
        gather_exposed_s=timing["gather_exposed_s"])


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
    k = cfg.devices  # the K workers split the micro-batches evenly: M a multiple of K
    rows = []
    for m in [m for m in divisors(cfg.batch_size) if m % k == 0]:
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

    def hides(j: int) -> bool:  # j * K micro-batches of ``per`` sequences per step
        return _exposed_share(_timing(replace(cfg, batch_size=j * k * per, micro_batches=j * k), shapes, rates,
                                      db)) <= max_exposed

    need, lo, hi = None, m0 // k, 2 * m0 // k
    while hi * k <= 1 << 24 and not hides(hi):  # the exposed share falls as the compute per fetch grows
        lo, hi = hi, hi * 2
    if hi * k <= 1 << 24:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hides(mid) else (mid, hi)
        need = hi * k * per
    why = (f"no M hides the link at batch {cfg.batch_size} (waits > {max_exposed:.0%} of the step): a layer's "
           "compute is shorter than its transfer" +
           (f"; a batch of {need} sequences ({need // per} micro-batches of {per}) would" if need
            else "; no batch would (the link is too slow)"))
    return MicroBatchChoice(None, why, rows, need)


def divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def pass_kinds(n_layers: int) -> list[str]:
    """The relay's passes in order: forward of every layer but the last, the post stage, backward."""
    return ["fwd"] * (n_layers - 1) + ["post"] + ["bwd"] * (n_layers - 1)
