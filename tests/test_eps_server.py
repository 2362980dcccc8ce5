"""The eager param-server: eagerness, waiting, K contributors, errors, checkpoints.

Every call that could block runs in a helper thread joined with a timeout, so a
broken server fails these tests instead of hanging them.
"""
from __future__ import annotations

import json
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from l2l.eps import OptimizerHyper, EagerParamServer, NumpyBackend, StepScalars
from l2l.eps import numerics
from l2l.eps.numerics import COPY_DTYPES, GRAD_DTYPES
from l2l.errors import EpsWorkerError

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

TIMEOUT = 10.0  # seconds; only ever reached when something hangs
HYPER = OptimizerHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def start(fn, *args, **kw):
    """Run ``fn`` in a daemon thread; returns (thread, box) with box['value'] or box['error']."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def call(fn, *args, timeout=TIMEOUT, **kw):
    """``fn(*args)`` that must finish within ``timeout`` seconds."""
    th, box = start(fn, *args, **kw)
    th.join(timeout)
    assert not th.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.itemsize]).copy()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def grads_for(rng, n, k, gdtype, scale=1e-2):
    return [(rng.standard_normal(n) * scale).astype(GRAD_DTYPES[gdtype]) for _ in range(k)]


class RecordingBackend(NumpyBackend):
    """NumpyBackend that records its calls and can hold ``gated`` layers' steps until released."""

    def __init__(self, gated=(), fail=()):
        super().__init__()
        self.gated = set(gated)
        self.fail = set(fail)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[int, str, StepScalars]] = []

    def step(self, layer, grads, scalars, copy_out, n_decay=None):
        self.calls.append((layer, threading.current_thread().name, scalars))
        if layer in self.gated:
            self.entered.set()
            if not self.release.wait(TIMEOUT):
                raise RuntimeError("test never released the gate")
        if layer in self.fail:
            raise RuntimeError(f"boom in layer {layer}")
        return super().step(layer, grads, scalars, copy_out, n_decay)


class Reference:
    """The same updates run synchronously on a plain NumpyBackend (the golden model)."""

    def __init__(self, hyper, cdtype):
        self.be = NumpyBackend()
        self.hyper = hyper
        self.cdtype = cdtype
        self.t: dict[int, int] = {}
        self.copies: dict[int, np.ndarray] = {}

    def add(self, layer, p):
        self.be.allocate(layer, np.asarray(p, np.float32).reshape(-1))
        self.t[layer] = 0
        self.copies[layer] = np.empty(p.size, COPY_DTYPES[self.cdtype])
        self.be.write_copy(layer, self.copies[layer])

    def step(self, layer, grads, divisor, loss_scale=1.0):
        s = StepScalars.compute(self.hyper, self.t[layer] + 1, loss_scale, divisor)
        if self.be.step(layer, grads, s, self.copies[layer]):
            self.t[layer] += 1
        return self.copies[layer]


def make_server(backend=None, **kw):
    return EagerParamServer(backend or NumpyBackend(), kw.pop("hyper", HYPER), **kw)


# --------------------------------------------------------------------------
# eagerness
# --------------------------------------------------------------------------


def test_push_returns_before_the_update_and_fetch_waits_for_that_layer_only():
    rng = np.random.default_rng(0)
    be = RecordingBackend(gated={0})
    srv = make_server(be)
    ref = Reference(HYPER, "fp32")
    p0, p1 = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(77).astype(np.float32)
    try:
        for layer, p in ((0, p0), (1, p1)):
            srv.add_layer(layer, p)
            ref.add(layer, p)
        # layer 1 updates (not gated) and is done
        g1 = grads_for(rng, 77, 1, "fp32")[0]
        srv.gradient_inbox(1)[:] = g1
        call(srv.push_gradient, 1, divisor=1.0)
        assert same_bits(call(srv.fetch, 1), ref.step(1, [g1], 1.0))

        # layer 0: push returns while its update is still running on the worker
        g0 = grads_for(rng, 1000, 1, "fp32")[0]
        srv.gradient_inbox(0)[:] = g0
        before = bits(srv.fetch(0))
        call(srv.push_gradient, 0, divisor=1.0, timeout=2.0)
        assert be.entered.wait(TIMEOUT), "the update never started"
        assert not be.release.is_set()
        assert srv.step_count(0) == 0
        assert [r.layer for r in srv.history] == [1]
        assert be.calls[-1][1].startswith("eps-update") and be.calls[-1][1] != threading.current_thread().name

        # fetch of ANOTHER layer does not wait
        waited = srv.wait_seconds
        t0 = time.perf_counter()
        assert same_bits(call(srv.fetch, 1, timeout=2.0), ref.copies[1])
        assert time.perf_counter() - t0 < 1.0
        assert srv.wait_seconds == waited  # nothing pending for layer 1: no waiting counted

        # fetch of THAT layer waits ...
        th, box = start(srv.fetch, 0)
        th.join(0.3)
        assert th.is_alive(), "fetch(0) returned before layer 0's update finished"
        assert np.array_equal(bits(srv._copies[0]), before)  # copy not yet written
        # ... until the update is done, and then gives the updated copy
        be.release.set()
        th.join(TIMEOUT)
        assert not th.is_alive() and "error" not in box, box
        assert same_bits(box["value"], ref.step(0, [g0], 1.0))
        assert srv.step_count(0) == 1
        # the blocked fetch counted its wait
        assert srv.wait_seconds - waited >= 0.2, srv.wait_seconds - waited
        assert srv.update_seconds > 0
    finally:
        be.release.set()
        call(srv.close)


def test_consecutive_updates_of_one_layer_chain_in_order():
    """Successive updates of one layer use t = 1, 2, 3 and the scalars of each push."""
    rng = np.random.default_rng(1)
    srv, ref = make_server(copy_dtype="bf16"), Reference(HYPER, "bf16")
    p = rng.standard_normal(300).astype(np.float32)
    srv.add_layer(5, p)
    ref.add(5, p)
    inbox = srv.gradient_inbox(5)
    for _ in range(3):
        g = grads_for(rng, 300, 1, "fp32")[0]
        call(srv.fetch, 5)  # the relay fetches before it overwrites the inbox
        inbox[:] = g
        srv.push_gradient(5, divisor=2.0, loss_scale=4.0)
        ref.step(5, [g], 2.0, 4.0)
    assert same_bits(call(srv.fetch, 5), ref.copies[5])
    assert srv.step_count(5) == 3
    assert [(r.layer, r.step, r.finite) for r in srv.history] == [(5, 1, True), (5, 2, True), (5, 3, True)]
    call(srv.close)


def test_ready_callback_is_awaited_by_the_worker():
    """push_gradient(ready=...) returns at once; the update reads the inbox after ready() returns."""
    rng = np.random.default_rng(2)
    srv, ref = make_server(), Reference(HYPER, "fp32")
    p = rng.standard_normal(64).astype(np.float32)
    srv.add_layer(0, p)
    ref.add(0, p)
    gate = threading.Event()
    g = grads_for(rng, 64, 1, "fp32")[0]
    try:
        call(srv.push_gradient, 0, divisor=1.0, ready=lambda: gate.wait(TIMEOUT), timeout=2.0)
        srv.gradient_inbox(0)[:] = g  # filled after the push, before ready() returns
        th, box = start(srv.fetch, 0)
        th.join(0.2)
        assert th.is_alive()
        gate.set()
        th.join(TIMEOUT)
        assert not th.is_alive() and "error" not in box, box
        assert same_bits(box["value"], ref.step(0, [g], 1.0))
    finally:
        gate.set()
        call(srv.close)


# --------------------------------------------------------------------------
# K contributors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gdtype,cdtype", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp16")])
def test_k_contributors_update_after_all_pushed_on_the_left_fold(gdtype, cdtype):
    K, n = 3, 500
    rng = np.random.default_rng(3)
    be = RecordingBackend()
    srv = make_server(be, contributors=K, grad_dtype=gdtype, copy_dtype=cdtype)
    p = (rng.standard_normal(n) * 0.02).astype(np.float32)
    srv.add_layer(0, p)
    assert srv.gradient_inbox(0, 1).dtype == GRAD_DTYPES[gdtype]
    assert srv.fetch(0).dtype == COPY_DTYPES[cdtype]
    # numerics by hand: left fold in contributor order, then AdamW
    P, M, V = p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t in range(1, 4):
        grads = grads_for(rng, n, K, gdtype)
        if gdtype == "fp32":  # make the fold order matter: (1 + u) + u != 1 + (u + u), u = 2**-24
            grads[0][:50], grads[1][:50], grads[2][:50] = 1.0, 2.0 ** -24, 2.0 ** -24
        for k in range(K):
            srv.gradient_inbox(0, k)[:] = grads[k]
        order = [2, 0, 1] if t % 2 else [1, 2, 0]  # push order does not matter
        for k in order[:-1]:
            srv.push_gradient(0, k, divisor=float(K), loss_scale=2.0)
        time.sleep(0.05)
        assert len(be.calls) == t - 1, "updated before all contributors pushed"
        assert srv.step_count(0) == t - 1
        with pytest.raises(RuntimeError):
            srv.push_gradient(0, order[0], divisor=float(K), loss_scale=2.0)  # twice in one step
        srv.push_gradient(0, order[-1], divisor=float(K), loss_scale=2.0)
        copy = call(srv.fetch, 0)
        s = StepScalars.compute(HYPER, t, loss_scale=2.0, divisor=float(K))
        assert be.calls[-1][2] == s
        g = np.empty(n, np.float32)
        assert numerics.reduce_gradients(grads, s.inv_scale, g)
        if gdtype == "fp32":
            other = np.empty(n, np.float32)
            numerics.reduce_gradients([grads[1], grads[2], grads[0]], s.inv_scale, other)
            assert not np.array_equal(other[:50], g[:50])  # the test can tell the orders apart
        want = np.empty(n, COPY_DTYPES[cdtype])
        numerics.adamw_update(P, M, V, g, s, copy_out=want)
        assert same_bits(copy, want), f"step {t}"
        assert srv.step_count(0) == t
    st = srv.state_tensors()
    assert same_bits(st["layer0.p"], P) and same_bits(st["layer0.m"], M) and same_bits(st["layer0.v"], V)
    with pytest.raises(ValueError):
        srv.push_gradient(0, K, divisor=1.0)
    with pytest.raises(ValueError):
        make_server(contributors=0)
    with pytest.raises(ValueError):
        srv.add_layer(0, p)
    call(srv.close)


# --------------------------------------------------------------------------
# worker errors
# --------------------------------------------------------------------------


def _failing_server(gated=()):
    be = RecordingBackend(fail={0}, gated=gated)
    srv = make_server(be)
    srv.add_layer(0, np.ones(10, np.float32))
    srv.add_layer(1, np.ones(10, np.float32))
    srv.gradient_inbox(0)[:] = 0.5
    srv.gradient_inbox(1)[:] = 0.5
    return srv


def _assert_worker_error(exc_info):
    assert isinstance(exc_info.value, EpsWorkerError)
    assert isinstance(exc_info.value.__cause__, RuntimeError) and "boom" in str(exc_info.value.__cause__)


def test_worker_error_surfaces_at_fetch_of_that_layer():
    srv = _failing_server()
    srv.push_gradient(0, divisor=1.0)
    t0 = time.perf_counter()
    with pytest.raises(EpsWorkerError) as info:
        call(srv.fetch, 0)
    assert time.perf_counter() - t0 < 2.0
    _assert_worker_error(info)
    # and at every later call, at once
    for fn, args, kw in ((srv.poll, (), {}), (srv.fetch, (1,), {}), (srv.fetch, (0,), {}),
                         (srv.push_gradient, (1,), {"divisor": 1.0}), (srv.synchronize, (), {})):
        with pytest.raises(EpsWorkerError) as info:
            call(fn, *args, timeout=2.0, **kw)
        _assert_worker_error(info)
    call(srv.close)


def test_worker_error_surfaces_at_poll_without_fetch():
    srv = _failing_server()
    srv.push_gradient(0, divisor=1.0)
    deadline = time.perf_counter() + 5.0
    while True:
        try:
            srv.poll()
        except EpsWorkerError as exc:
            assert "boom" in str(exc.__cause__)
            break
        assert time.perf_counter() < deadline, "poll() never reported the worker error"
        time.sleep(0.005)
    with pytest.raises(EpsWorkerError):
        call(srv.push_gradient, 1, divisor=1.0, timeout=2.0)
    call(srv.close)


def test_worker_error_at_fetch_of_another_layer_and_queued_updates_do_not_hang():
    srv = _failing_server(gated={0})
    srv.push_gradient(0, divisor=1.0)
    assert srv.backend.entered.wait(TIMEOUT)
    srv.push_gradient(0, divisor=1.0)  # a second update of the failing layer, chained behind it
    srv.push_gradient(1, divisor=1.0)  # another layer's update queued behind the failure
    srv.backend.release.set()          # now the first update fails
    with pytest.raises(EpsWorkerError):
        call(srv.fetch, 1)
    with pytest.raises(EpsWorkerError):
        call(srv.fetch, 0)
    with pytest.raises(EpsWorkerError):
        call(srv.state_tensors)
    call(srv.close)


def test_error_in_ready_callback_surfaces():
    srv = make_server()
    srv.add_layer(0, np.ones(4, np.float32))

    def ready():
        raise RuntimeError("boom: the gradient never arrived")

    srv.push_gradient(0, divisor=1.0, ready=ready)
    with pytest.raises(EpsWorkerError) as info:
        call(srv.fetch, 0)
    _assert_worker_error(info)
    assert srv.step_count(0) == 0
    call(srv.close)


# --------------------------------------------------------------------------
# non-finite gradients
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gdtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_gradient_skips_the_update(gdtype, bad):
    rng = np.random.default_rng(4)
    n, K = 40, 2
    srv = make_server(contributors=K, grad_dtype=gdtype, copy_dtype="bf16")
    ref = Reference(HYPER, "bf16")
    p = rng.standard_normal(n).astype(np.float32)
    srv.add_layer(0, p)
    ref.add(0, p)

    def step(grads):
        for k in range(K):
            srv.gradient_inbox(0, k)[:] = grads[k]
        for k in range(K):
            srv.push_gradient(0, k, divisor=2.0)
        return bits(call(srv.fetch, 0))

    good = grads_for(rng, n, K, gdtype)
    assert np.array_equal(step(good), bits(ref.step(0, good, 2.0)))
    state = {k: v.copy() for k, v in srv.state_tensors().items()}
    copy_before = bits(srv.fetch(0))

    badg = grads_for(rng, n, K, gdtype)
    badg[1][17] = bad
    assert np.array_equal(step(badg), copy_before), "device copy changed"
    assert srv.step_count(0) == 1
    assert (srv.history[-1].layer, srv.history[-1].step, srv.history[-1].finite) == (0, 1, False)
    for key, val in srv.state_tensors().items():
        assert same_bits(val, state[key]), f"{key} changed on a non-finite gradient"
    ref.step(0, badg, 2.0)
    assert ref.t[0] == 1

    # the next finite step is the layer's 2nd update (t = 2), as in the reference
    good2 = grads_for(rng, n, K, gdtype)
    assert np.array_equal(step(good2), bits(ref.step(0, good2, 2.0)))
    assert srv.step_count(0) == 2
    assert [(r.step, r.finite) for r in srv.history] == [(1, True), (1, False), (2, True)]
    call(srv.close)


def _close_while_layer_0_updates(srv):
    """close() while layer 0's update runs (gated) and layer 1's waits behind it: layer 0 is
    let go only once close has begun (the worker takes no new work, and today's close has
    cancelled what was queued)."""
    be = srv.backend
    for layer in (0, 1):
        srv.add_layer(layer, np.ones(10, np.float32))
        srv.gradient_inbox(layer)[:] = 0.5
        srv.push_gradient(layer, divisor=1.0)
    assert be.entered.wait(TIMEOUT)
    shutdown = srv._worker.shutdown

    def shutdown_then_release(wait=True, *, cancel_futures=False):
        shutdown(wait=False, cancel_futures=cancel_futures)
        be.release.set()
        shutdown(wait=wait)
    srv._worker.shutdown = shutdown_then_release
    call(srv.close)


def test_close_lets_the_queued_updates_finish():
    """A step's last updates are applied by close, not dropped: the state a caller reads
    after it (or the disk tier's files) is the step's."""
    srv = make_server(RecordingBackend(gated={0}))
    _close_while_layer_0_updates(srv)
    assert [(r.layer, r.step, r.finite) for r in srv.history] == [(0, 1, True), (1, 1, True)]
    assert srv.step_count(1) == 1 and not same_bits(srv.state_tensors()["layer1.p"], np.ones(10, np.float32))


def test_close_raises_an_update_error_it_waited_for_once():
    """An update that fails while close waits for it is raised by close (no one else would
    see it); an error already raised is not raised again."""
    srv = make_server(RecordingBackend(gated={0}, fail={1}))
    with pytest.raises(EpsWorkerError) as info:
        _close_while_layer_0_updates(srv)
    assert "boom in layer 1" in str(info.value.__cause__)
    with pytest.raises(EpsWorkerError):
        srv.poll()
    srv = _failing_server()
    srv.push_gradient(0, divisor=1.0)
    with pytest.raises(EpsWorkerError):
        call(srv.fetch, 0)
    call(srv.close)


# --------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------


def _drive(srv, rng_seed, steps, K, gdtype, sizes):
    rng = np.random.default_rng(rng_seed)
    for _ in range(steps):
        for layer, n in sizes.items():
            grads = grads_for(rng, n, K, gdtype)
            call(srv.fetch, layer)
            for k in range(K):
                srv.gradient_inbox(layer, k)[:] = grads[k]
            for k in range(K):
                srv.push_gradient(layer, k, divisor=float(K), loss_scale=8.0)
    srv.synchronize()


def test_state_round_trip_gives_bit_identical_updates():
    sizes = {0: 129, 3: 7, 4: 1}
    K, gdtype, cdtype = 2, "bf16", "fp16"
    rng = np.random.default_rng(5)
    a = make_server(contributors=K, grad_dtype=gdtype, copy_dtype=cdtype)
    b = make_server(contributors=K, grad_dtype=gdtype, copy_dtype=cdtype)
    for layer, n in sizes.items():
        a.add_layer(layer, (rng.standard_normal(n) * 0.02).astype(np.float32))
        b.add_layer(layer, rng.standard_normal(n).astype(np.float32))  # different init, overwritten
    _drive(a, 10, 3, K, gdtype, sizes)
    # one more layer-0 update in flight while the checkpoint is taken: state_tensors waits for it
    _drive(a, 11, 1, K, gdtype, {0: 129})
    tensors = a.state_tensors()
    meta = json.loads(json.dumps(a.state_meta()))  # survives a JSON file
    assert set(tensors) == {f"layer{l}.{k}" for l in sizes for k in "pmv"}
    assert all(t.dtype == np.float32 and t.shape == (sizes[int(k[5:].split('.')[0])],) for k, t in tensors.items())
    assert a.step_count(0) == 4 and a.step_count(3) == 3
    b.load_state(tensors, meta)
    for layer in sizes:
        assert b.step_count(layer) == a.step_count(layer)
        assert same_bits(call(b.fetch, layer), call(a.fetch, layer))
    # the checkpoint is a copy: scribbling on it changes nothing
    for t in tensors.values():
        t[:] = np.nan
    _drive(a, 12, 3, K, gdtype, sizes)
    _drive(b, 12, 3, K, gdtype, sizes)
    ta, tb = a.state_tensors(), b.state_tensors()
    for key in ta:
        assert same_bits(ta[key], tb[key]), key
    for layer in sizes:
        assert same_bits(call(a.fetch, layer), call(b.fetch, layer))
        assert b.step_count(layer) == a.step_count(layer)
    with pytest.raises(ValueError):
        b.load_state({k: v for k, v in ta.items() if k != "layer3.m"}, a.state_meta())
    call(a.close)
    call(b.close)


def test_state_tensors_waits_for_pending_updates():
    be = RecordingBackend(gated={0})
    srv = make_server(be)
    srv.add_layer(0, np.ones(8, np.float32))
    srv.gradient_inbox(0)[:] = 1.0
    try:
        srv.push_gradient(0, divisor=1.0)
        assert be.entered.wait(TIMEOUT)
        th, box = start(srv.state_tensors)
        th.join(0.2)
        assert th.is_alive(), "state_tensors did not wait for the pending update"
        be.release.set()
        th.join(TIMEOUT)
        assert not th.is_alive() and "error" not in box
        assert not np.array_equal(box["value"]["layer0.p"], np.ones(8, np.float32))
        assert srv.state_meta() == {"steps": {"0": 1}, "n_decay": {"0": 8}, "optimizer": "adamw"}
    finally:
        be.release.set()
        call(srv.close)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
def test_host_arrays_start_on_a_cache_line(dtype, n):
    """The EPS's host arrays (device copies, inboxes) start on 64-byte boundaries: the
    OpenCL EPS's streaming stores and vector kernels rely on it for full speed."""
    from l2l.hostmem import aligned_empty
    a = aligned_empty(n, dtype)
    assert a.shape == (n,) and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert n == 0 or a.ctypes.data % 64 == 0  # (an empty array has no data to place)
    a[:] = 1
    assert (a == 1).all()


def test_update_records_are_bounded_and_read_by_cursor():
    """A long run keeps a few steps' records, not one per update forever; a reader that
    reads every step sees each record once, and one that fell behind is told."""
    from l2l.eps.server import HISTORY_STEPS
    srv = EagerParamServer(NumpyBackend(), HYPER)
    try:
        for layer in range(3):
            srv.add_layer(layer, np.zeros(16, np.float32))
        cursor, seen = 0, []
        for _ in range(10 * HISTORY_STEPS):
            for layer in (2, 1, 0):
                srv.gradient_inbox(layer)[:] = 1.0
                srv.push_gradient(layer, divisor=1.0)
            srv.synchronize()
            new, cursor = srv.records_since(cursor)
            seen += new
        assert len(srv.history) == HISTORY_STEPS * 3 and srv.records_total == 30 * HISTORY_STEPS
        assert [r.layer for r in seen] == [2, 1, 0] * (10 * HISTORY_STEPS)
        assert [r.step for r in seen if r.layer == 0] == list(range(1, 10 * HISTORY_STEPS + 1))
        with pytest.raises(RuntimeError, match="dropped"):
            srv.records_since(0)
    finally:
        srv.close()


def test_gradient_inboxes_are_held_only_while_their_layer_is_in_flight():
    """A layer's inbox block goes back once its update has read it and serves the next layer of
    its shape: eight layers whose updates finish in turn use one block, with the same updates
    as eight blocks would give; a layer still in flight keeps its own."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(8)]
    results = []
    for in_turn in (True, False):
        srv = make_server()
        for layer in range(8):
            srv.add_layer(layer, np.full(64, 0.5, np.float32))
        seen = set()
        for layer in reversed(range(8)):  # the relay's backward order
            inbox = srv.gradient_inbox(layer)
            seen.add(inbox.ctypes.data)
            inbox[:] = grads[layer]
            srv.push_gradient(layer, divisor=1.0)
            if in_turn:
                srv.synchronize()
        srv.synchronize()
        results.append([srv.state_tensors()[f"layer{i}.p"] for i in range(8)])
        if in_turn:
            assert srv.inbox_blocks == 1 and len(seen) == 1
        assert srv.inbox_blocks <= 8
        srv.close()
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    held = make_server()  # a pushed layer whose update has not run keeps its block
    held.add_layer(0, np.zeros(8, np.float32))
    held.add_layer(1, np.zeros(8, np.float32))
    held.hold()
    first = held.gradient_inbox(0)
    first[:] = 1.0
    held.push_gradient(0, divisor=1.0)
    assert held.gradient_inbox(1).ctypes.data != first.ctypes.data
    held.close()


def test_a_relay_step_holds_a_few_inboxes_not_one_per_layer(corpus):
    """Through the relay, eight same-shaped blocks share the inboxes of the layers in flight."""
    from l2l.models import ModelConfig, build_stack
    from l2l.relay.engine import RelayEngine
    from conftest import CPU, sampler_for
    cfg = ModelConfig(layers=8, d_model=32, heads=2, seq_len=16)
    eps = make_server()
    engine = RelayEngine(build_stack(cfg, 0), eps, CPU, micro_batches=2)
    try:
        for step in range(2):
            engine.train_step(sampler_for(corpus, cfg, batch_size=4).batch(step), step)
    finally:
        engine.close()
    assert eps.inbox_blocks < 8 + 2  # pre, 8 blocks, post: three shapes


def test_fp32_masters_serve_as_the_copies_where_the_device_reads_host_memory():
    """share_masters (the CPU device): the fetched copy is the NumPy EPS's p itself, so the server
    keeps no copy bytes, and the run is bit for bit the one with a separate copy; bf16 copies and
    other backends keep theirs."""
    shared = EagerParamServer(NumpyBackend(), HYPER, share_masters=True)
    apart = EagerParamServer(NumpyBackend(), HYPER)
    rng = np.random.default_rng(3)
    w = rng.standard_normal(1000).astype(np.float32)
    for srv in (shared, apart):
        srv.add_layer(0, w)
    assert shared.fetch(0) is shared.backend.master_as_copy(0)
    assert not np.shares_memory(apart.fetch(0), apart.backend.master_as_copy(0))
    assert shared.copy_bytes == 0 and apart.copy_bytes == 4 * 1000
    for step in range(3):
        g = rng.standard_normal(1000).astype(np.float32)
        for srv in (shared, apart):
            srv.gradient_inbox(0)[...] = g
            srv.push_gradient(0, divisor=1.0)
            srv.synchronize()
        assert np.array_equal(shared.fetch(0), apart.fetch(0))
    for k, a in apart.state_tensors().items():
        assert np.array_equal(shared.state_tensors()[k], a), k
    bf16 = EagerParamServer(NumpyBackend(), HYPER, copy_dtype="bf16", grad_dtype="bf16", share_masters=True)
    bf16.add_layer(0, w)
    assert bf16.fetch(0).dtype != np.float32 and bf16.copy_bytes == 2 * 1000
