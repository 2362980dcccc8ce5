"""The relay goes on with the next layer while the EPS updates the last one."""
from __future__ import annotations

import threading


from l2l.eps import OptimizerHyper, NumpyBackend
from l2l.errors import EpsWorkerError
from l2l.models import ModelConfig

from conftest import relay, sampler_for

CFG = ModelConfig(layers=4, d_model=32, heads=2, seq_len=16)


class GatedBackend(NumpyBackend):
    """Holds the post stage's update until the relay has pushed the gradient of a
    layer further down. A relay that waited for updates would deadlock here."""

    def __init__(self, post: int, release_at: int) -> None:
        super().__init__()
        self.post, self.release_at = post, release_at
        self.gate = threading.Event()
        self.timed_out = False

    def step(self, layer, grads, scalars, copy_out, n_decay=None):
        if layer == self.post and not self.gate.wait(timeout=30):
            self.timed_out = True
        return super().step(layer, grads, scalars, copy_out, n_decay)


def test_backward_continues_while_update_is_pending(corpus):
    post = CFG.layers + 1
    backend = GatedBackend(post=post, release_at=1)
    engine = relay(CFG, OptimizerHyper(), micro_batches=2, backend=backend)
    pushed = []
    original = engine.eps.push_gradient

    def spy(layer, *args, **kwargs):
        pushed.append(layer)
        original(layer, *args, **kwargs)
        if layer == backend.release_at:
            backend.gate.set()

    engine.eps.push_gradient = spy
    engine.train_step(sampler_for(corpus, CFG, 4).batch(0), 0)
    engine.eps.synchronize()
    assert not backend.timed_out
    assert pushed == list(range(post, -1, -1))
    assert [r.layer for r in engine.eps.history] == pushed


class FailingBackend(NumpyBackend):
    def step(self, layer, grads, scalars, copy_out, n_decay=None):
        if layer == 3:
            raise MemoryError("card DRAM gone")
        return super().step(layer, grads, scalars, copy_out, n_decay)


def test_worker_error_surfaces_in_the_training_loop(corpus):
    engine = relay(CFG, OptimizerHyper(), micro_batches=2, backend=FailingBackend())
    result = {}

    def run():
        try:
            engine.train_step(sampler_for(corpus, CFG, 4).batch(0), 0)
            engine.train_step(sampler_for(corpus, CFG, 4).batch(1), 1)
        except BaseException as exc:  # noqa: BLE001 -- the test inspects it
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "relay hung on a failed EPS update"
    assert isinstance(result.get("error"), EpsWorkerError)
    assert "card DRAM gone" in str(result["error"])
