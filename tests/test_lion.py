"""Lion (``--optimizer lion``): the golden model against the contract evaluated independently
(tests/eps_oracle.py), the NumPy EPS's threads and contributions against one thread, the plain
engine's torch Lion against the golden model, and ``l2l train`` on a Hugging Face model against
timm's ``Lion`` with Trainer's parameter groups, relay and plain engine, from the command line."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from l2l.checkpoint import load_latest
from l2l.eps import EagerParamServer, LionScalars, NumpyBackend, OptimizerHyper, numerics
from l2l.eps.contract import step_scalars
from l2l.lion import Lion
from l2l.models.pretrained import checkpoint_keys
from conftest import run_cli, timm_optimizers, trainer_groups
from eps_oracle import Oracle, bits_of, round_bits, wide_f32
from test_decay_groups import STEPS, qwen2_and_corpus, reference, train_flags, train_losses

HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.99, weight_decay=0.3, warmup_steps=4, min_lr_ratio=0.1)


def _scalars(**kw) -> LionScalars:
    return step_scalars(OptimizerHyper(**{"lr": 3e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.3,
                                          "optimizer": "lion", **kw}), 1)


def _cases(rng, n):
    """Wide values over every binade, zeros of both signs where ``c`` is a zero, moments and
    gradients that cancel exactly (``b1*m == -(omb1*g)``)."""
    p, m, g = (wide_f32(rng, n, max_abs=1e30) for _ in range(3))
    s = _scalars()
    q = n // 8
    m[:q], g[:q] = np.where(rng.random(q) < 0.5, -0.0, 0.0), np.where(rng.random(q) < 0.5, -0.0, 0.0)
    # b1 = 0.9f and omb1 = 0.1f: m = omb1 * k, g = -b1 * k gives exact products that cancel when
    # both are exact, as they are for small integers k scaled by powers of two
    k = rng.integers(1, 1 << 10, q).astype(np.float32) * np.float32(2.0 ** -20)
    m[q:2 * q] = k
    g[q:2 * q] = -(np.float32(s.b1) * k / np.float32(s.omb1)).astype(np.float32)
    return p, m, g


@pytest.mark.parametrize("n_decay", [None, 0, 1, 77, numerics.CHUNK + 5])
def test_golden_model_is_the_contract(n_decay):
    rng = np.random.default_rng(7)
    n = numerics.CHUNK + 300  # two chunks
    p, m, g = _cases(rng, n)
    s = _scalars()
    oracle = Oracle()
    want_p, want_m = oracle.lion(p.astype(np.float64), m.astype(np.float64), g.astype(np.float64), s,
                                 n_decay=n_decay)
    copy = np.empty(n, ml_dtypes.bfloat16)
    got_p, got_m = p.copy(), m.copy()
    numerics.lion_update(got_p, got_m, g, s, copy_out=copy, n_decay=n_decay)
    assert np.array_equal(bits_of(got_p), round_bits(want_p, "fp32")[0]), "p'"
    assert np.array_equal(bits_of(got_m), round_bits(want_m, "fp32")[0]), "m'"
    assert np.array_equal(copy.view(np.uint16), oracle.copy_bits(want_p, "bf16").astype(np.uint16)), "copy"
    still = (m == 0) & (g == 0)  # c is a zero: p' is p1, its own sign of zero kept
    assert still.sum() > 100
    p1 = p if n_decay == 0 else np.where(np.arange(n) < (n if n_decay is None else n_decay), p * s.decay, p)
    assert np.array_equal(bits_of(got_p[still]), bits_of(p1[still].astype(np.float32)))


def test_numpy_eps_threads_and_contributions_give_one_threads_bits():
    """K = 2 bf16 contributions, bf16 copies, a decay boundary inside a thread's range, through
    the server: two threads on small ranges give one thread's bits, step after step."""
    rng = np.random.default_rng(3)
    n = 5000
    p0 = rng.standard_normal(n).astype(np.float32)
    out = []
    for backend in (NumpyBackend(threads=1), NumpyBackend(threads=2, grain=64)):
        srv = EagerParamServer(backend, OptimizerHyper(lr=1e-3, weight_decay=0.1, optimizer="lion"),
                               copy_dtype="bf16", grad_dtype="bf16", contributors=2)
        srv.add_layer(0, p0, n_decay=3001)
        for step in range(4):
            g = np.random.default_rng(step).standard_normal((2, n)).astype(ml_dtypes.bfloat16)
            for k in range(2):
                srv.gradient_inbox(0, k)[...] = g[k]
                srv.push_gradient(0, k, divisor=3.0)
            srv.synchronize()
        out.append((srv.state_tensors(), np.array(srv.fetch(0))))
        assert set(out[-1][0]) == {"layer0.p", "layer0.m"}  # one moment: 8 bytes a parameter
        srv.close()
    (a, ca), (b, cb) = out
    for key in a:
        assert np.array_equal(a[key].view(np.uint32), b[key].view(np.uint32)), key
    assert np.array_equal(ca.view(np.uint16), cb.view(np.uint16))


def test_golden_model_is_close_to_timms_lion():
    """timm interpolates with lerp; the contract multiplies and adds: 10 steps apart by rounding
    only (no element stepped the other way)."""
    TimmLion, _ = timm_optimizers()
    rng = np.random.default_rng(0)
    n = 200_000
    p = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    ref = torch.tensor(p.copy(), requires_grad=True)
    opt = TimmLion([ref], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    hyper = OptimizerHyper(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, optimizer="lion")
    for t in range(1, 11):
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        g[:1000] = 0.0  # with m = 0 at the first step: no move, in both
        ref.grad = torch.from_numpy(g.copy())
        opt.step()
        numerics.lion_update(p, m, g, step_scalars(hyper, t))
    want_p, want_m = ref.detach().numpy(), opt.state[ref]["exp_avg"].numpy()
    assert np.max(np.abs(p - want_p)) <= 1e-6 * np.max(np.abs(want_p))
    assert np.max(np.abs(m - want_m)) <= 1e-6 * np.max(np.abs(want_m))


def test_plain_engines_lion_is_the_golden_model():
    """l2l.lion.Lion (the plain engine's) rounds as the contract does: the same bits, with two
    parameter groups (decayed, not decayed)."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(3000).astype(np.float32), rng.standard_normal(700).astype(np.float32)
    pa, pb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    opt = Lion([{"params": [pa], "weight_decay": 0.2}, {"params": [pb], "weight_decay": 0.0}],
               lr=2e-3, betas=(0.9, 0.99))
    p, m = np.concatenate([a, b]), np.zeros(3700, np.float32)
    hyper = OptimizerHyper(lr=2e-3, beta1=0.9, beta2=0.99, weight_decay=0.2, optimizer="lion")
    for t in range(1, 6):
        g = rng.standard_normal(3700).astype(np.float32)
        g[:50] = 0.0
        pa.grad, pb.grad = torch.from_numpy(g[:3000].copy()), torch.from_numpy(g[3000:].copy())
        opt.step()
        numerics.lion_update(p, m, g, step_scalars(hyper, t), n_decay=3000)
    got = np.concatenate([pa.detach().numpy(), pb.detach().numpy()])
    assert np.array_equal(got.view(np.uint32), p.view(np.uint32))
    got_m = np.concatenate([opt.state[pa]["exp_avg"].numpy(), opt.state[pb]["exp_avg"].numpy()])
    assert np.array_equal(got_m.view(np.uint32), m.view(np.uint32))


# ---------------------------------------------------------------- l2l train against timm


@pytest.fixture(scope="module")
def lion_run(tmp_path_factory, trainer_decay_names):
    """The tiny Qwen2 and corpus, and Hugging Face's model trained by timm's Lion with
    Trainer's groups on the batches and learning rates of ``l2l train``."""
    TimmLion, _ = timm_optimizers()
    directory, data = qwen2_and_corpus(tmp_path_factory.mktemp("lion"))
    lion = lambda hf: TimmLion(trainer_groups(hf, trainer_decay_names(hf), HYPER["weight_decay"]),  # noqa: E731
                               lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]))
    return directory, data, reference(directory, data, lion, HYPER)


def _flags(directory: Path, data: Path, out: Path, steps: int = STEPS) -> list[str]:
    return train_flags(directory, data, out, {**HYPER, "optimizer": "lion"}, steps)


@pytest.mark.parametrize("engine", ["l2l", "plain"])
def test_twenty_steps_equal_timms_lion(engine, lion_run, tmp_path):
    directory, data, (want_losses, want_weights) = lion_run
    out = tmp_path / engine
    r = run_cli(*_flags(directory, data, out), "--engine", engine)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(out)
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(want, rel=1e-5), step
    saved = load_latest(out)
    assert not any(k.endswith(".v") for k in saved.tensors)  # Lion keeps p and m only
    stack, keys = checkpoint_keys(str(out / "model"))
    moved = total = 0
    for e in range(stack.num_entries):
        flat = saved.tensors[f"layer{e}.p"]
        for slot, key in zip(stack.entry_layout(e)[1].slots, keys[e]):
            got = flat[slot.offset:slot.offset + slot.numel].reshape(slot.shape)
            diff = np.abs(got.astype(np.float64) - want_weights[key])
            # a sign step is lr: a weight that stepped the other way once differs by about 2 lr.
            # The sum of gradients in another order may flip a c within rounding of zero; rare.
            moved += int(np.sum(diff > HYPER["lr"] / 2))
            total += diff.size
            assert np.max(diff) <= 4 * HYPER["lr"] * 1.01, key
    assert moved <= max(3, total // 100_000), (moved, total)


def test_resume_refuses_another_optimizer(lion_run, tmp_path):
    directory, data, _ = lion_run
    out = tmp_path / "run"
    assert run_cli(*_flags(directory, data, out, steps=2)).returncode == 0
    flags = _flags(directory, data, out, steps=3)
    flags[flags.index("--optimizer=lion")] = "--optimizer=adamw"
    r = run_cli(*flags, "--resume")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "optimizer was 'lion', now 'adamw'" in r.stderr, r.stderr[-1000:]


def test_an_unknown_optimizer_is_one_line(tmp_path):
    r = run_cli("train", "--optimizer", "adam", "--steps", "1", "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "unknown --optimizer 'adam'; choose one of adamw, lion" in r.stderr


@pytest.mark.parametrize("optimizer, regions", [("lion", 2), ("lamb", 3)])
def test_state_on_disk_gives_the_bits_of_memory(tmp_path, optimizer, regions):
    """``--eps-offload``: the state files hold p and the optimizer's moments (Lion: p, m), and
    the run's checkpoint is the in-memory run's, bit for bit (LAMB: both passes on the slab)."""
    from l2l.eps.disk_tier import BLOCK
    base = ["train", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
            "--micro-batches", "2", "--steps", "3", "--eval-every", "0", "--eval-batches", "1", "--no-plot",
            "--optimizer", optimizer, "--lr", "1e-3"]
    runs = {}
    for name, extra in (("memory", []), ("disk", ["--eps-offload", str(tmp_path / "eps")])):
        r = run_cli(*base, "--out", str(tmp_path / name), *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = load_latest(tmp_path / name).tensors
    assert set(runs["memory"]) == set(runs["disk"])
    assert any(k.endswith(".v") for k in runs["disk"]) == (optimizer == "lamb")
    for key, want in runs["memory"].items():
        assert np.array_equal(runs["disk"][key].view(np.uint32), want.view(np.uint32)), key
    manifest = json.loads((tmp_path / "eps" / "manifest.json").read_text())
    for entry, numel in manifest["entries"].items():
        region = -(-4 * numel // BLOCK) * BLOCK
        assert (tmp_path / "eps" / f"entry{int(entry):05d}.state").stat().st_size == BLOCK + regions * region
