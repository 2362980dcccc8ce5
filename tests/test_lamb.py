"""LAMB (``--optimizer lamb``): the golden model's two passes and the host's fold against the
contract evaluated independently (tests/eps_oracle.py), the NumPy EPS's threads against one
thread, and ``l2l train`` on a Hugging Face model against timm's ``Lamb`` with Trainer's
parameter groups, relay and plain engine, from the command line."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, NumpyBackend, OptimizerHyper, numerics
from l2l.eps.contract import step_scalars
from l2l.eps.shards import BLOCK
from l2l.models.pretrained import checkpoint_keys
from conftest import run_cli, timm_optimizers, trainer_groups
from eps_oracle import Oracle, bits_of, round_bits
from test_decay_groups import STEPS, qwen2_and_corpus, reference, train_flags, train_losses

HYPER = dict(lr=2e-3, beta1=0.9, beta2=0.99, adam_eps=1e-6, weight_decay=0.05, warmup_steps=4, min_lr_ratio=0.1)


def _hyper(**kw) -> OptimizerHyper:
    return OptimizerHyper(**{"lr": 2e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05,
                             "optimizer": "lamb", **kw})


def test_lane_sums_add_in_index_order():
    """Each lane is a left fold of its elements in index order, from +0: NumPy's reduction over
    the rows of a (rows, 16) array adds row by row, not pairwise."""
    rng = np.random.default_rng(0)
    for n in (1, 15, 16, 17, 1000, BLOCK):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
        got = np.empty(numerics.LANES, np.float32)
        numerics._lane_sums(x, got)
        want = np.zeros(numerics.LANES, np.float32)
        for i, xi in enumerate(x):
            want[i % numerics.LANES] = np.float32(want[i % numerics.LANES] + xi)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n


def test_segments_are_tensors_cut_at_blocks():
    seg = numerics.lamb_segments([0, 100, 70_000], 200_000)
    assert list(seg.bounds) == [0, 100, BLOCK, 70_000, 2 * BLOCK, 3 * BLOCK, 200_000]
    assert list(seg.tensor) == [0, 1, 1, 2, 2, 2]
    part = numerics.lamb_segments([0, 100, 70_000], 200_000, lo=BLOCK, hi=2 * BLOCK)  # a shard's slice
    assert list(part.bounds) == [0, 70_000 - BLOCK, BLOCK] and list(part.tensor) == [1, 2]
    with pytest.raises(ValueError):
        numerics.lamb_segments([0, 100], 1000, lo=50)
    assert numerics.lamb_segments([0], 0).count == 0                              # an entry with no elements
    assert numerics.lamb_segments([0, 100], 2 * BLOCK, lo=BLOCK, hi=BLOCK).count == 0  # an empty slice


def test_an_entry_with_no_elements_counts_its_steps():
    """A tied Llama's pre stage holds no weight (the shared entry does): its LAMB update is
    bookkeeping, not an error."""
    srv = EagerParamServer(NumpyBackend(1), _hyper())
    srv.add_layer(0, np.zeros(0, np.float32))
    srv.add_layer(1, np.ones(100, np.float32))
    for layer in (0, 1):
        srv.gradient_inbox(layer)[...] = 0.5
        srv.push_gradient(layer, divisor=1.0)
    srv.synchronize()
    assert [srv.step_count(0), srv.step_count(1)] == [1, 1]
    srv.close()


@pytest.mark.parametrize("n_decay", [None, 0, 300])
def test_golden_model_is_the_contract(n_decay):
    """Four tensors (one all zeros: its trust ratio is 1), one across a block boundary."""
    rng = np.random.default_rng(5)
    n = BLOCK + 700
    starts = [0, 300, 500, 900]
    p = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 2, n)).astype(np.float32)
    p[300:500] = 0.0
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 1e-3).astype(np.float32)
    g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    s = step_scalars(_hyper(), 3)
    nd = n if n_decay is None else n_decay
    seg = numerics.lamb_segments(starts, n)
    want_p, want_m, want_v, want_sums = Oracle().lamb(*(a.astype(np.float64) for a in (p, m, v, g)), s,
                                                      seg.bounds, seg.tensor, seg.tensor_starts, nd)
    gp, gm, gv = p.copy(), m.copy(), v.copy()
    sums = numerics.lamb_norms(gp, gm, gv, g, s, seg, n_decay=nd)
    assert np.array_equal(bits_of(sums.reshape(-1)), round_bits(want_sums.reshape(-1), "fp32")[0])
    assert np.array_equal(gp, p)  # the norm pass leaves p
    steps = numerics.lamb_steps(sums, seg, s, nd)
    copy = np.empty(n, ml_dtypes.bfloat16)
    numerics.lamb_apply(gp, gm, gv, s, seg, steps, copy_out=copy, n_decay=nd)
    for name, got, want in (("p'", gp, want_p), ("m'", gm, want_m), ("v'", gv, want_v)):
        assert np.array_equal(bits_of(got), round_bits(want, "fp32")[0]), name
    assert np.array_equal(copy.view(np.uint16), Oracle().copy_bits(want_p, "bf16").astype(np.uint16))
    adapted = steps != np.float32(-2e-3)
    assert adapted.any() == (nd > 0)  # decayed tensors with non-zero norms take their ratio
    assert not adapted[seg.tensor == 1].any()  # the zero tensor: trust 1


def test_numpy_eps_threads_give_one_threads_bits():
    """Two threads on small ranges (cutting segments: each takes those that start in its range),
    K = 2 bf16 contributions, bf16 copies, through the server, step after step."""
    rng = np.random.default_rng(3)
    n = 5000
    p0 = rng.standard_normal(n).astype(np.float32)
    p0[1000:1500] = 0.0
    out = []
    for backend in (NumpyBackend(threads=1), NumpyBackend(threads=2, grain=64)):
        srv = EagerParamServer(backend, _hyper(), copy_dtype="bf16", grad_dtype="bf16", contributors=2)
        srv.add_layer(0, p0, n_decay=3000, tensor_starts=[0, 1000, 1500, 3000, 4000])
        for step in range(4):
            g = np.random.default_rng(step).standard_normal((2, n)).astype(ml_dtypes.bfloat16)
            for k in range(2):
                srv.gradient_inbox(0, k)[...] = g[k]
                srv.push_gradient(0, k, divisor=3.0)
            srv.synchronize()
        out.append((srv.state_tensors(), np.array(srv.fetch(0))))
        srv.close()
    (a, ca), (b, cb) = out
    assert set(a) == {"layer0.p", "layer0.m", "layer0.v"}
    for key in a:
        assert np.array_equal(a[key].view(np.uint32), b[key].view(np.uint32)), key
    assert np.array_equal(ca.view(np.uint16), cb.view(np.uint16))


def test_golden_model_is_close_to_timms_lamb():
    """Three tensors, one all zeros, decayed; one not decayed (timm: not adapted either). 10 steps
    of the golden model against timm's Lamb (no gradient clipping): rounding apart."""
    _, TimmLamb = timm_optimizers()
    rng = np.random.default_rng(0)
    sizes = [3000, 500, 700]
    p = np.concatenate([rng.standard_normal(3000), np.zeros(500), rng.standard_normal(700)]).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    ref = [torch.tensor(x, requires_grad=True) for x in np.split(p.copy(), np.cumsum(sizes)[:-1])]
    opt = TimmLamb([{"params": ref[:2], "weight_decay": 0.05}, {"params": ref[2:], "weight_decay": 0.0}],
                   lr=2e-3, betas=(0.9, 0.99), eps=1e-6, max_grad_norm=None)
    hyper = _hyper()
    seg = numerics.lamb_segments([0, 3000, 3500], p.size)
    for t in range(1, 11):
        g = (rng.standard_normal(p.size) * 1e-2).astype(np.float32)
        for r, x in zip(ref, np.split(g, np.cumsum(sizes)[:-1])):
            r.grad = torch.from_numpy(x.copy())
        opt.step()
        s = step_scalars(hyper, t)
        sums = numerics.lamb_norms(p, m, v, g, s, seg, n_decay=3500)
        numerics.lamb_apply(p, m, v, s, seg, numerics.lamb_steps(sums, seg, s, 3500), n_decay=3500)
    want = np.concatenate([r.detach().numpy() for r in ref])
    assert np.max(np.abs(p - want)) <= 1e-6 * np.max(np.abs(want))


# ---------------------------------------------------------------- l2l train against timm


@pytest.fixture(scope="module")
def lamb_run(tmp_path_factory, trainer_decay_names):
    """The tiny Qwen2 and corpus, and Hugging Face's model trained by timm's Lamb (no gradient
    clipping of its own) with Trainer's groups on the batches and learning rates of ``l2l train``."""
    _, TimmLamb = timm_optimizers()
    directory, data = qwen2_and_corpus(tmp_path_factory.mktemp("lamb"))
    lamb = lambda hf: TimmLamb(trainer_groups(hf, trainer_decay_names(hf), HYPER["weight_decay"]),  # noqa: E731
                               lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["adam_eps"],
                               max_grad_norm=None)
    return directory, data, reference(directory, data, lamb, HYPER)


def _flags(directory: Path, data: Path, out: Path) -> list[str]:
    return train_flags(directory, data, out, {**HYPER, "optimizer": "lamb"})


@pytest.mark.parametrize("engine", ["l2l", "plain"])
def test_twenty_steps_equal_timms_lamb(engine, lamb_run, tmp_path):
    directory, data, (want_losses, want_weights) = lamb_run
    out = tmp_path / engine
    r = run_cli(*_flags(directory, data, out), "--engine", engine)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(out)
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(want, rel=1e-5), step
    stack, keys = checkpoint_keys(str(out / "model"))
    saved = load_latest(out)
    diff = total = 0.0
    for e in range(stack.num_entries):
        flat = saved.tensors[f"layer{e}.p"]
        for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
            got = flat[slot.offset:slot.offset + slot.numel].reshape(slot.shape).astype(np.float64)
            want = want_weights[key].astype(np.float64)
            assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), key
            diff, total = diff + np.sum((got - want) ** 2), total + np.sum(want ** 2)
    assert (diff / total) ** 0.5 <= 1e-5

