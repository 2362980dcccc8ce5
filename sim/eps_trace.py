"""Record every EPS update of a real training run, for replay through the RTL kernel.

Recording wraps the NumPy backend from the outside (:class:`RecordingBackend`,
an :class:`~l2l.eps.backend.EpsBackend` that delegates to
:class:`~l2l.eps.NumpyBackend`): at every ``step`` it copies the layer's
state before the update (``read_state``), the K gradient contributions as the
server handed them over, the step scalars, the decay boundary ``n_decay`` (the
parameter groups: elements below it are weight-decayed), the finite flag, the
state after the update and the device copy. Nothing under host/ is changed: the wrapper is
passed to :class:`~l2l.eps.EagerParamServer` like any backend, and the run is
the library's own relay (:class:`~l2l.relay.engine.RelayEngine`, or
:class:`~l2l.relay.parallel.DataParallelRelay` for K > 1 contributions) on a
tiny byte-level GPT over the stdlib corpus, so the trace holds the values a
training run really produces (small weights, tiny moments, gradients over
many binades, fp16 loss-scale overflows when they happen).

A skipped update is made to happen at a chosen place with a :class:`Poison`:
one element of one contributor's gradient of one layer at one step is set to
a non-finite value as the EPS receives it, the way a diverging worker or an
overflow on one device would deliver it. Everything after is the library's
own behaviour: the NumPy EPS finds the reduced gradient not finite and
returns False without touching the layer (docs/eps-numerics.md, "finite"),
the server keeps the layer's step count, so the layer's next update runs
with the same ``t`` again, and the other layers go on. A bf16 run has no
loss scaling (fp32's exponent range), so without a poison its trace would
hold no skipped update at all. In the same way ``decay_split`` gives chosen
layers a decay boundary where the server passed none (all decayed), as a
server with parameter groups asks for: what the NumPy EPS does with it is
recorded, and the replay writes it to the kernel's n_decay register.

The optimizer is the run's (``record(optimizer=...)``, ``--optimizer`` on the
command line): AdamW's updates hold the state ``(p, m, v)`` and
:class:`~l2l.eps.contract.StepScalars`, Lion's ``(p, m)`` (``v`` and
``v_out`` are None) and :class:`~l2l.eps.contract.LionScalars`, LAMB's
``(p, m, v)``, :class:`~l2l.eps.contract.LambScalars` (its host-only ``lr`` and
``adapt`` too, for the fold between the passes) and the entry's tensor starts
(its segments are ``numerics.lamb_segments`` of them); the trace's header names
the optimizer, and a trace without one is AdamW's.

:func:`record` runs and saves a trace (``.npz``: bit patterns, so bfloat16
and binary16 survive any NumPy); :func:`load` reads one back as
:class:`Trace`; :func:`grad_words` turns a (K, n) gradient block into the
words the kernel's ``gr`` buffer holds (the K contributions back to back).
Loading needs only NumPy (the cocotb process never imports torch).

    .venv/bin/python sim/eps_trace.py trace.npz --optimizer lion --precision bf16 --contributors 2
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from l2l.eps.backend import EpsBackend
from l2l.eps.contract import OPTIMIZERS, LambScalars, LambStep, StepScalars, optimizer_of
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES, as_step

_UINT = {2: np.uint16, 4: np.uint32}


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.dtype.itemsize])


@dataclass
class Update:
    """One EPS layer update as the NumPy backend saw and did it."""
    layer: int
    grads: np.ndarray          # (K, n), the gradient dtype
    scalars: StepScalars       # (LionScalars in a Lion run)
    n_decay: int               # elements [0, n_decay) weight-decayed (n: all)
    p: np.ndarray              # state before (float32)
    m: np.ndarray
    v: np.ndarray | None       # None in a Lion run (state p, m)
    finite: bool
    p_out: np.ndarray          # state after (unchanged when not finite)
    m_out: np.ndarray
    v_out: np.ndarray | None
    copy_out: np.ndarray       # the device copy after the update (the copy dtype)
    tensor_starts: np.ndarray | None = None   # LAMB: the entry's tensors (its segments), else None


@dataclass
class Trace:
    gdtype: str
    cdtype: str
    updates: list[Update]
    meta: dict
    optimizer: str = "adamw"


@dataclass(frozen=True)
class Poison:
    """Set ``grads[contributor, index]`` of ``layer``'s update at training step ``step``
    (0-based, counted per layer) to ``value`` before the EPS sees it."""
    step: int
    layer: int
    contributor: int
    index: int
    value: float = float("inf")


class RecordingBackend(EpsBackend):
    """An EPS backend that runs ``inner`` and records every ``step`` it is asked for.

    With ``poison``, the gradient block of that one update is copied, the chosen
    element set, and the copy handed to ``inner`` and recorded: the server's
    inbox is not written (it is the server's, and reused). ``decay_split``
    (``{layer: n_decay}``) replaces the boundary of those layers (one the model's own
    parameter groups do not hit: mid-beat, a burst edge); every other layer's boundary,
    the server's, is forwarded as it is.
    """

    name = "recording"
    optimizers = frozenset(OPTIMIZERS)     # whatever the inner backend runs (it checks)

    def __init__(self, inner: EpsBackend, poison: Poison | None = None,
                 decay_split: dict[int, int] | None = None) -> None:
        self.inner = inner
        self.poison = poison
        self.decay_split = dict(decay_split or {})
        self.updates: list[Update] = []
        self._count: dict[int, int] = {}    # layer -> step calls so far

    def allocate(self, layer: int, p: np.ndarray, moments: int = 2) -> None:
        self.inner.allocate(layer, p, moments)

    def step(self, layer: int, grads: Sequence[np.ndarray], scalars: StepScalars,
             copy_out: np.ndarray, n_decay: int | None = None) -> bool:
        p, m, *v = self.inner.read_state(layer)        # v: [v] (AdamW) or [] (Lion)
        n_decay = self.decay_split.get(layer, n_decay)
        starts = None
        if isinstance(scalars, LambStep):    # the fold must see the boundary the passes see
            starts = np.asarray(scalars.segments.tensor_starts, np.int64)
            scalars = as_step(scalars.scalars, p.shape[0], n_decay, starts)
        g = np.array(np.stack([np.asarray(x) for x in grads]) if not isinstance(grads, np.ndarray)
                     else grads, copy=True)
        at = self._count.get(layer, 0)
        self._count[layer] = at + 1
        q = self.poison
        if q is not None and (q.step, q.layer) == (at, layer):
            g[q.contributor, q.index] = q.value    # to the gradient dtype: inf and NaN survive
            grads = g
        finite = self.inner.step(layer, grads, scalars, copy_out, n_decay=n_decay)
        p2, m2, *v2 = self.inner.read_state(layer)
        self.updates.append(Update(layer, g, scalars.scalars if starts is not None else scalars,
                                   p.shape[0] if n_decay is None else int(n_decay),
                                   p, m, v[0] if v else None, bool(finite), p2, m2, v2[0] if v2 else None,
                                   np.array(copy_out, copy=True), starts))
        return finite

    def write_copy(self, layer: int, copy_out: np.ndarray) -> None:
        self.inner.write_copy(layer, copy_out)

    def read_state(self, layer: int):
        return self.inner.read_state(layer)

    def write_state(self, layer: int, p, *moments) -> None:
        self.inner.write_state(layer, p, *moments)

    def close(self) -> None:
        self.inner.close()


def record(path: str | Path, *, precision: str = "fp32", contributors: int = 1, steps: int = 2,
           d_model: int = 4, heads: int = 1, layers: int = 1, seq_len: int = 8, batch_size: int = 4,
           micro_batches: int = 2, lr: float = 2e-3, seed: int = 0, poison: Poison | None = None,
           decay_split: dict[int, int] | None = None, optimizer: str = "adamw") -> Trace:
    """Train a tiny GPT for ``steps`` steps with the recording NumPy EPS; save and return the trace.

    ``precision`` (fp32, bf16, fp16) is the relay's compute precision and so the
    gradient and device-copy dtype; ``contributors`` > 1 runs a data-parallel
    relay of that many CPU workers, whose gradients are the EPS's K contributions.
    ``poison`` makes one update non-finite (see :class:`Poison`); ``decay_split``
    (``{layer: n_decay}``) gives those layers a decay boundary (see
    :class:`RecordingBackend`); both are kept in the trace's ``meta``.
    ``optimizer`` (adamw, lion, lamb) is the EPS's (``OptimizerHyper.optimizer``).
    """
    import torch

    from l2l.data import BatchSampler, load_corpus
    from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
    from l2l.models import ModelConfig, build_stack, family
    from l2l.relay.engine import RelayEngine

    cfg = ModelConfig(family="gpt", layers=layers, d_model=d_model, heads=heads, seq_len=seq_len, dropout=0.0)
    rec = RecordingBackend(NumpyBackend(), poison, decay_split)
    eps = EagerParamServer(rec, OptimizerHyper(lr=lr, optimizer=optimizer), copy_dtype=precision, grad_dtype=precision,
                           contributors=contributors)
    cpu = torch.device("cpu")
    if contributors == 1:
        engine = RelayEngine(build_stack(cfg, seed), eps, cpu, micro_batches=micro_batches,
                             precision=precision, seed=seed)
    else:
        from l2l.relay.parallel import DataParallelRelay
        engine = DataParallelRelay([build_stack(cfg, seed) for _ in range(contributors)], eps,
                                   [cpu] * contributors, micro_batches=micro_batches, precision=precision,
                                   seed=seed)
    corpus = load_corpus(None)
    sampler = BatchSampler(corpus.train, cfg.seq_len, batch_size, family(cfg.family).objective, seed=seed)
    losses = []
    try:
        for step in range(steps):
            losses.append(float(engine.train_step(sampler.batch(step), step).loss))
        eps.synchronize()
    finally:
        eps.close()
    meta = {"precision": precision, "contributors": contributors, "steps": steps, "model": cfg.to_dict(),
            "lr": lr, "losses": losses, "poison": None if poison is None else vars(poison),
            "decay_split": {str(k): v for k, v in (decay_split or {}).items()}, "optimizer": optimizer}
    trace = Trace(precision, precision, list(rec.updates), meta, optimizer)
    save(trace, path)
    return trace


def save(trace: Trace, path: str | Path) -> None:
    arrays = {}
    index = []
    for i, u in enumerate(trace.updates):
        index.append({"layer": u.layer, "finite": u.finite, "n_decay": u.n_decay})
        if isinstance(u.scalars, LambScalars):   # the fold's own values, and the segments
            index[-1].update(lr=u.scalars.lr, adapt=bool(u.scalars.adapt),
                             tensor_starts=[int(t) for t in u.tensor_starts])
        arrays[f"{i}.grads"] = _bits(u.grads)
        arrays[f"{i}.scalars"] = np.asarray(u.scalars.as_tuple(), np.float32).view(np.uint32)
        if optimizer_of(u.scalars).name != trace.optimizer:
            raise ValueError(f"update {i}: {type(u.scalars).__name__} in a {trace.optimizer} trace")
        for name in ("p", "m", "v", "p_out", "m_out", "v_out", "copy_out"):
            if getattr(u, name) is not None:
                arrays[f"{i}.{name}"] = _bits(getattr(u, name))
    head = {"gdtype": trace.gdtype, "cdtype": trace.cdtype, "optimizer": trace.optimizer, "updates": index,
            "meta": trace.meta}
    arrays["header"] = np.frombuffer(json.dumps(head).encode(), np.uint8)
    np.savez_compressed(path, **arrays)


def load(path: str | Path) -> Trace:
    with np.load(path) as z:
        head = json.loads(z["header"].tobytes().decode())
        gdt, cdt = GRAD_DTYPES[head["gdtype"]], COPY_DTYPES[head["cdtype"]]
        optimizer = head.get("optimizer", "adamw")         # a trace from before Lion is AdamW's
        scalars = OPTIMIZERS[optimizer].scalars
        f32 = lambda a: a.view(np.float32)  # noqa: E731
        v_of = lambda key: f32(z[key]) if key in z.files else None  # noqa: E731
        updates = []
        for i, ent in enumerate(head["updates"]):
            s = scalars(*(np.float32(x) for x in z[f"{i}.scalars"].view(np.float32)))
            starts = None
            if scalars is LambScalars:
                s = LambScalars(*s.as_tuple(), lr=float(ent["lr"]), adapt=bool(ent["adapt"]))
                starts = np.asarray(ent["tensor_starts"], np.int64)
            updates.append(Update(
                layer=ent["layer"], grads=z[f"{i}.grads"].view(gdt), scalars=s,
                # a trace from before the parameter groups decayed every element
                n_decay=int(ent.get("n_decay", z[f"{i}.p"].shape[0])),
                p=f32(z[f"{i}.p"]), m=f32(z[f"{i}.m"]), v=v_of(f"{i}.v"), finite=ent["finite"],
                p_out=f32(z[f"{i}.p_out"]), m_out=f32(z[f"{i}.m_out"]), v_out=v_of(f"{i}.v_out"),
                copy_out=z[f"{i}.copy_out"].view(cdt), tensor_starts=starts))
    return Trace(head["gdtype"], head["cdtype"], updates, head["meta"], optimizer)


def grad_words(grads: np.ndarray) -> np.ndarray:
    """The (K, n) contributions as one run of words, contribution 0 first (the ``gr`` buffer)."""
    return _bits(np.ascontiguousarray(grads)).reshape(-1)


def main(argv: list[str] | None = None) -> int:
    """Record a trace from the command line (the tests call :func:`record` themselves)."""
    import argparse

    ap = argparse.ArgumentParser(description="record every EPS update of a tiny training run")
    ap.add_argument("out", type=Path, help="the trace file to write (.npz)")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--precision", choices=sorted(COPY_DTYPES), default="fp32",
                    help="compute precision: the gradient and device-copy dtype")
    ap.add_argument("--contributors", type=int, default=1, help="data-parallel workers (K)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    trace = record(args.out, precision=args.precision, contributors=args.contributors, steps=args.steps,
                   d_model=args.d_model, seq_len=args.seq_len, lr=args.lr, optimizer=args.optimizer)
    skipped = sum(not u.finite for u in trace.updates)
    print(f"{args.out}: {len(trace.updates)} {trace.optimizer} updates ({skipped} not finite), "
          f"{trace.gdtype} gradients, K = {args.contributors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
