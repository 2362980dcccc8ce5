"""The relay's early-stopping recompute (relay/recompute.py) and weight binding (relay/binding.py)."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend
from l2l.models import ModelConfig, build_stack
from l2l.relay.engine import RelayEngine
from l2l.relay.binding import WeightBinding
from l2l.relay.recompute import Recorder, WeightSinks
from threaded_transport import ThreadedTransport

from conftest import CPU, sampler_for


def _engine(cfg, micro_batches, transport=None):
    stack = build_stack(cfg, seed=0)
    eps = EagerParamServer(NumpyBackend(), OptimizerHyper(lr=1e-3))
    return RelayEngine(stack, eps, CPU, micro_batches=micro_batches, transport=transport)


def test_recompute_stops_before_the_blocks_last_projection(corpus):
    """Each block's output projection runs once per micro-batch (the forward), never in
    the recompute: the recompute stops once it has rebuilt the tensors backward needs."""
    cfg = ModelConfig(layers=3, d_model=64, heads=2, seq_len=32, dropout=0.0)
    engine = _engine(cfg, micro_batches=4)
    finished, started = [], []
    for layer in engine.layers[1:-1]:
        layer.module.out.register_forward_pre_hook(lambda m, a: started.append(m))
        layer.module.out.register_forward_hook(lambda m, a, y: finished.append(m))
        layer.module.fc.register_forward_hook(lambda m, a, y: finished.append(m))
    try:
        engine.train_step(sampler_for(corpus, cfg, batch_size=8).batch(0), 0)
    finally:
        engine.close()
    outs = [m for m in finished if isinstance(m, nn.Linear) and m.out_features == cfg.d_model]
    assert len(outs) == 3 * 4           # forward only: 3 blocks x 4 micro-batches
    assert len(finished) - len(outs) == 2 * 3 * 4  # fc: forward and recompute
    assert len(started) == 2 * 3 * 4    # the recompute enters `out`, and stops at its first saved input


def test_gradients_equal_a_plain_recompute_bit_for_bit():
    """Early stop changes which ops run, not what backward computes."""
    torch.manual_seed(0)
    block = build_stack(ModelConfig(layers=1, d_model=32, heads=2, seq_len=16), seed=0,
                        materialize=True).layers[1].module
    x = torch.randn(3, 16, 32)
    g = torch.randn(3, 16, 32)
    weights = {n: p.detach().clone() for n, p in block.named_parameters()}

    ref_w = {n: w.clone().requires_grad_() for n, w in weights.items()}
    ref_x = x.clone().requires_grad_()
    torch.func.functional_call(block, ref_w, (ref_x,)).backward(g)

    binding = WeightBinding(block, CPU)
    recorder, sinks = Recorder(CPU), WeightSinks()
    with binding.bound(recorder.tap_weights(weights, sinks)) as module:
        y, rec = recorder.forward(module, x)
    grads = {n: torch.zeros_like(w) for n, w in weights.items()}
    sinks.grads = grads
    with binding.bound(recorder.leaves(weights)) as module:
        xl = recorder.leaf(x)
        gx = rec.backward(lambda: module(xl), g)
    assert torch.equal(gx, ref_x.grad)
    for n in weights:
        assert torch.equal(grads[n], ref_w[n].grad), n


def test_a_recompute_that_diverges_from_its_forward_is_refused():
    class Moody(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            x = self.lin(x)
            return x.sum(-1, keepdim=True) * x if self.calls == 1 else torch.tanh(x)[:, :2] * 2

    module = Moody()
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    binding = WeightBinding(module, CPU)
    recorder, sinks = Recorder(CPU), WeightSinks()
    with binding.bound(recorder.tap_weights(weights, sinks)) as m:
        _, rec = recorder.forward(m, torch.randn(2, 4))
    sinks.grads = {n: torch.zeros_like(w) for n, w in weights.items()}
    with binding.bound(recorder.leaves(weights)) as m, pytest.raises(RuntimeError, match="diverged"):
        rec.backward(lambda: m(recorder.leaf(torch.randn(2, 4))), torch.ones(2, 4))


def test_the_recorded_graph_keeps_no_weights_alive(corpus):
    """Between forward and backward only graph nodes wait: with a transport that really
    copies, every forward upload of a block's weights is freed once the block is done."""
    cfg = ModelConfig(layers=4, d_model=32, heads=2, seq_len=16, dropout=0.0)
    engine = _engine(cfg, micro_batches=2, transport=ThreadedTransport(CPU))
    uploads = []
    upload = engine.transport.upload

    def tracked(host):
        pending = upload(host)
        uploads.append(weakref.ref(pending.wait()))
        return pending

    engine.transport.upload = tracked
    alive_at_backward = []

    def count(module, args):
        gc.collect()
        alive_at_backward.append(sum(r() is not None for r in uploads))

    engine.layers[-1].module.register_forward_pre_hook(count)
    try:
        engine.train_step(sampler_for(corpus, cfg, batch_size=4).batch(0), 0)
    finally:
        engine.close()
    # at the post stage: its own weights and (prefetched) the last block's, nothing of the forward
    assert alive_at_backward and max(alive_at_backward) <= 3, (alive_at_backward, len(uploads))


def test_a_tied_weight_is_bound_everywhere_it_appears():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    module = Tied()
    names = [n for n, _ in module.named_parameters()]
    assert names == ["a.weight"]
    binding = WeightBinding(module, CPU)
    assert module.a.weight.is_meta and module.b.weight.is_meta
    w = torch.randn(3, 3)
    x = torch.randn(2, 3)
    with binding.bound({"a.weight": w}) as m:
        np.testing.assert_allclose(m(x).numpy(), (x @ w.T @ w.T).numpy(), rtol=1e-6)
    assert module.a.weight.is_meta and module.b.weight.is_meta  # placeholders back
