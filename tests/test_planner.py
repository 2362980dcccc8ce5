"""The planner (``l2l plan``): its formulas on tiny configs, its memory terms against the
relay's own ledger, the pipeline and EPS arithmetic on made-up rates, the choice of M
on a made-up slow link, and one real check of a predicted step time on this CPU."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from l2l.planner import measure as planner_measure
from l2l.config import TrainConfig
from l2l.models import build_stack
from l2l.planner import (Rates, meta_layer_shapes, calibrate, choose_micro_batches, fit_calibration,
                         gpt_layer_shapes, layer_shapes, measure_rates, predict, time_relay_steps)
from l2l.planner.command import run_plan
from l2l.build import build_engine

from conftest import CPU, run_cli, sampler_for

# ---------------------------------------------------------------- shapes and FLOPs


@pytest.mark.parametrize("layers,d,seq", [(1, 32, 16), (3, 64, 32), (2, 48, 8)])
def test_gpt_parameter_counts_equal_the_real_stack(layers, d, seq):
    cfg = TrainConfig(layers=layers, d_model=d, heads=2, seq_len=seq)
    stack = build_stack(cfg.model_config(), 0)
    shapes = layer_shapes(cfg)
    assert [s.params for s in shapes] == [layer.layout.numel for layer in stack.layers]
    assert sum(s.params for s in shapes) == stack.num_params
    vocab = stack.vocab_size
    assert shapes[0].params == vocab * d + seq * d
    assert all(s.params == 12 * d * d + 13 * d for s in shapes[1:-1])
    assert shapes[-1].params == d * vocab + 2 * d


def test_counting_on_the_meta_device_agrees_with_the_formulas():
    cfg = TrainConfig(layers=2, d_model=32, heads=2, seq_len=16)
    # the meta count cannot tell which matmuls the recompute skips: it assumes none
    assert meta_layer_shapes(cfg) == [replace(s, tail_matmul_params=0) for s in gpt_layer_shapes(2, 32, 16)]


def test_hf_models_are_counted_from_their_stack():
    pytest.importorskip("transformers")
    for model in ("hf-gpt2", "hf-bert"):
        cfg = TrainConfig(model=model, layers=2, d_model=32, heads=2, seq_len=16)
        stack = build_stack(cfg.model_config(), 0)
        assert [s.params for s in layer_shapes(cfg)] == [layer.layout.numel for layer in stack.layers]


def test_flops_of_a_step():
    cfg = TrainConfig(layers=2, d_model=32, heads=2, seq_len=16, batch_size=4, micro_batches=2)
    b, t, d, v = 2, 16, 32, 256
    block = 2 * 12 * d * d * b * t + 4 * b * t * t * d   # matmuls + QK^T and AV
    post = 2 * d * v * b * t
    shapes = layer_shapes(cfg)
    assert shapes[1].forward_flops(b, t, d) == block
    p = predict(cfg, Rates(flops_per_s=1e9))
    # blocks: forward, recompute (stopping before out's 4d^2), backward (2x) = 4x less the
    # skipped projection; post: forward + backward = 3x; per micro-batch
    skipped = 2 * 4 * d * d * b * t
    assert p.flops == pytest.approx(2 * (2 * (4 * block - skipped) + 3 * post))
    assert p.compute_s == pytest.approx(p.flops / 1e9)


# ---------------------------------------------------------------- memory


def _real_step(corpus, cfg: TrainConfig):
    engine = build_engine(cfg, build_stack(cfg.model_config(), 0), CPU)
    try:
        result = engine.train_step(sampler_for(corpus, cfg.model_config(), cfg.batch_size).batch(0), 0)
        return result, engine.ledger.host_stash_peak
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stash", ["device", "host"])
def test_memory_terms_equal_the_relay_ledger(corpus, stash, precision):
    cfg = TrainConfig(layers=3, d_model=32, heads=2, seq_len=16, batch_size=6, micro_batches=3, stash=stash,
                      precision=precision, device="cpu")
    result, host_stash = _real_step(corpus, cfg)
    p = predict(cfg, Rates(flops_per_s=1e9))
    assert p.device_weight_bytes == result.device_weight_peak_bytes
    assert p.device_ledger_bytes == result.device_peak_bytes
    assert p.host_stash_bytes == host_stash
    db = 4 if precision == "fp32" else 2
    n_block, act = 12 * 32 * 32 + 13 * 32, 2 * 16 * 32 * db
    assert p.device_weight_bytes == 2 * db * n_block  # weights + gradient of the largest layer
    if stash == "device":   # every block boundary, every micro-batch (+ the one in hand)
        assert p.device_ledger_bytes == p.device_weight_bytes + (4 * 3 + 1) * act
    else:                   # one micro-batch's boundary and its upstream gradient
        assert p.device_ledger_bytes == p.device_weight_bytes + 2 * act
    largest = max(s.params for s in layer_shapes(cfg))  # p, m, v and device copy; 2 layers' inboxes
    copy = 0 if precision == "fp32" else db  # the CPU in fp32: the NumPy EPS's masters are the copies
    assert p.host_eps_bytes == (12 + copy) * p.params + 2 * largest * db
    assert p.host_state_bytes == (12 + copy) * p.params
    assert p.device_total_bytes == p.device_ledger_bytes + p.activation_bytes
    assert p.activation_bytes == max(24 * 32 * 32, (2 * 256 + 2 * 32) * 32) * db


@pytest.mark.parametrize("eps", ["auto", "numpy", "opencl", "hls-csim"])
def test_the_planned_copies_are_the_servers(eps):
    """On the CPU in fp32 the planner counts a device copy only where the EPS keeps one beside
    its masters: the server's own account (copy_bytes) of an engine built for the config. The
    NumPy EPS and the OpenCL EPS on a CPU device keep none (eps.shares_masters says which, without
    building one); bf16 copies are always kept."""
    from l2l.eps import shares_masters
    for precision in ("fp32", "bf16"):
        cfg = TrainConfig(layers=2, d_model=32, heads=2, seq_len=16, batch_size=2, micro_batches=1,
                          precision=precision, device="cpu", eps=eps)
        p = predict(cfg, Rates(flops_per_s=1e9))
        engine = build_engine(cfg, build_stack(cfg.model_config(), 0), CPU)
        try:
            assert p.host_state_bytes == 12 * p.params + engine.eps.copy_bytes, precision
            if precision == "fp32":
                choice = cfg.eps_choice()
                assert (engine.eps.copy_bytes == 0) is shares_masters(choice.name, **choice.options)
        finally:
            engine.close()
    assert shares_masters("numpy") and not shares_masters("hls-csim") and not shares_masters("no such eps")
    assert not shares_masters("opencl", device="no such device")


def test_memory_with_prefetch_and_half_precision():
    cfg = TrainConfig(layers=4, d_model=256, heads=4, seq_len=16, batch_size=2, micro_batches=1)
    n = 12 * 256 * 256 + 13 * 256
    linked = Rates(flops_per_s=1e12, link_bytes_per_s=1e10)
    assert predict(cfg, linked).device_weight_bytes == 3 * 4 * n    # w_i + g_i + the next w prefetched
    half = predict(cfg, Rates(flops_per_s=1e12), dtype_bytes=2)
    assert half.device_weight_bytes == 2 * 2 * n
    assert half.host_eps_bytes == (12 + 2) * half.params + 2 * n * 2  # and two blocks' bf16 inboxes


# ---------------------------------------------------------------- pipeline and EPS


def test_zero_copy_step_is_compute_plus_the_first_layers_update():
    cfg = TrainConfig(layers=4, d_model=64, heads=2, seq_len=32, batch_size=8, micro_batches=2)
    n_pre, n_block = layer_shapes(cfg)[0].params, layer_shapes(cfg)[1].params
    # the embedding's backward has no matmul FLOPs: only its calls cover the last block's update
    rates = Rates(flops_per_s=1e9, eps_elems_per_s=1e9, per_call_s=1e-3)
    p = predict(cfg, rates)
    assert p.transfer_s == 0 and p.transfer_hidden_share == 1.0
    assert p.eps_exposed_s == pytest.approx(n_pre / 1e9)  # the rest hides under backward
    bare = predict(cfg, replace(rates, per_call_s=0.0))
    assert bare.eps_exposed_s == pytest.approx((n_pre + n_block) / 1e9)
    assert p.step_s == pytest.approx(p.compute_s + p.eps_exposed_s)


def test_slow_eps_is_exposed_by_what_does_not_fit_under_backward():
    cfg = TrainConfig(layers=4, d_model=64, heads=2, seq_len=32, batch_size=8, micro_batches=2)
    p = predict(cfg, Rates(flops_per_s=1e9, eps_elems_per_s=1e4))
    # every update waits for the one before: the worker starts after post, runs them all
    assert p.eps_exposed_s == pytest.approx(p.eps_update_s - p.backward_s)


def test_transfers_hide_under_compute_except_the_first_fetch_and_the_last_gradient():
    cfg = TrainConfig(layers=4, d_model=256, heads=4, seq_len=128, batch_size=16, micro_batches=1)
    n_pre = layer_shapes(cfg)[0].params
    bw = 1e11
    # per-call cost gives the embedding's passes (no matmul FLOPs) time to cover block 0's copies
    p = predict(cfg, Rates(flops_per_s=1e11, link_bytes_per_s=bw, eps_elems_per_s=1e12, per_call_s=1e-3))
    assert p.transfer_exposed_s == pytest.approx(2 * 4 * n_pre / bw, rel=1e-6)
    assert 0.9 < p.transfer_hidden_share < 1.0
    slow = predict(cfg, Rates(flops_per_s=1e11, link_bytes_per_s=1e7, eps_elems_per_s=1e12))
    weights_in = sum(d["weights_in_s"] for d in slow.layers_detail)
    assert slow.step_s > 2 * weights_in  # copies run one after another: the link sets the pace
    assert slow.transfer_exposed_s == pytest.approx(slow.step_s - slow.compute_s - slow.eps_exposed_s)
    assert slow.transfer_hidden_share < 0.5


def test_host_stash_copies_are_paid_on_a_real_link():
    cfg = TrainConfig(layers=2, d_model=64, heads=2, seq_len=32, batch_size=4, micro_batches=2, stash="host")
    act = 2 * 32 * 64 * 4
    p = predict(cfg, Rates(flops_per_s=1e12, link_bytes_per_s=1e9))
    # per micro-batch: activations 3 * 3 - 1 = 8 moves, boundary gradients 2 * 3 = 6 (last = 3)
    assert p.stash_transfer_s == pytest.approx(2 * (8 + 6) * act / 1e9)
    assert predict(replace(cfg, stash="device"), Rates(flops_per_s=1e12, link_bytes_per_s=1e9)).stash_transfer_s == 0


def test_calibration_recovers_the_efficiency_and_the_per_call_cost(monkeypatch):
    """Steps timed as the model says (efficiency 0.6, 150 µs a call) give those back."""
    truth = Rates(flops_per_s=2e11, efficiency=0.6, per_call_s=150e-6, eps_elems_per_s=1e12)
    monkeypatch.setattr(planner_measure, "time_relay_steps",
                        lambda cfgs, device, **kw: [predict(c, truth).step_s for c in cfgs])
    cfg = TrainConfig(layers=8, d_model=256, heads=4, seq_len=128, batch_size=16, micro_batches=4)
    fitted = calibrate(cfg, Rates(flops_per_s=2e11, eps_elems_per_s=1e12), "cpu")
    assert fitted.efficiency == pytest.approx(0.6, rel=1e-4)  # the exposed EPS is subtracted as predicted
    assert fitted.per_call_s == pytest.approx(150e-6, rel=1e-4)
    points = fitted.notes["calibration"]["points"]
    assert [p["micro_batches"] for p in points] == [1, 8] and fitted.notes["calibration"]["layers"] == 4
    # no per-call cost in the times: none fitted, and never a negative one
    monkeypatch.setattr(planner_measure, "time_relay_steps", lambda cfgs, device, **kw: [
        predict(c, replace(truth, per_call_s=0.0)).step_s * (1.02 if c.micro_batches == 1 else 1.0) for c in cfgs])
    fitted = calibrate(cfg, Rates(flops_per_s=2e11, eps_elems_per_s=1e12), "cpu")
    assert fitted.per_call_s == 0.0 and fitted.efficiency == pytest.approx(0.6, rel=0.03)


# ---------------------------------------------------------------- choosing M


def _waits(cfg, rates) -> float:
    p = predict(cfg, rates)
    return p.transfer_exposed_s / p.step_s


def test_no_micro_batch_count_hides_a_slow_link_but_a_larger_batch_does():
    cfg = TrainConfig(layers=4, d_model=256, heads=4, seq_len=128, batch_size=8, micro_batches=1)
    slow = Rates(flops_per_s=1e11, link_bytes_per_s=2e8, eps_elems_per_s=1e12, per_call_s=1e-4)
    choice = choose_micro_batches(cfg, slow, max_exposed=0.05)
    assert choice.micro_batches is None
    assert [r["micro_batches"] for r in choice.candidates] == [1, 2, 4, 8]
    assert all(r["exposed_share"] > 0.05 for r in choice.candidates)
    need = choice.min_batch_to_hide
    assert need is not None and need > cfg.batch_size and need % cfg.batch_size == 0
    assert _waits(replace(cfg, batch_size=need, micro_batches=need // 8), slow) <= 0.05
    before = need - cfg.batch_size
    assert _waits(replace(cfg, batch_size=before, micro_batches=before // 8), slow) > 0.05
    # where M = 1 does not fit, the larger batch is counted in micro-batches of 4 (M = 2)
    sizes = {m: predict(replace(cfg, micro_batches=m), slow).device_total_bytes for m in (1, 2)}
    tight = choose_micro_batches(cfg, slow, device_memory_bytes=(sizes[1] + sizes[2]) // 2)
    assert [r["fits"] for r in tight.candidates] == [False, True, True, True]
    assert tight.micro_batches is None and tight.min_batch_to_hide % 4 == 0


def test_a_fast_link_takes_the_smallest_m_that_fits():
    cfg = TrainConfig(layers=4, d_model=256, heads=4, seq_len=128, batch_size=8, micro_batches=1)
    fast = Rates(flops_per_s=1e11, link_bytes_per_s=1e12, eps_elems_per_s=1e12, per_call_s=1e-4)
    assert choose_micro_batches(cfg, fast).micro_batches == 1
    sizes = {m: predict(replace(cfg, micro_batches=m), fast).device_total_bytes for m in (1, 2, 4, 8)}
    assert sizes[1] > sizes[2] > sizes[4]
    assert choose_micro_batches(cfg, fast, device_memory_bytes=sizes[4]).micro_batches == 4
    assert choose_micro_batches(cfg, fast, device_memory_bytes=1).micro_batches is None


# ---------------------------------------------------------------- the command


def test_run_plan_json_and_table(capsys):
    common = ["--layers", "2", "--d-model", "64", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
              "--micro-batches", "2", "--flops", "1e11", "--eps-rate", "5e8"]
    assert run_plan(common + ["--link-gbps", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prediction"]["step_s"] > 0 and out["prediction"]["transfer_s"] == 0
    assert out["micro_batches"]["micro_batches"] == 1
    assert run_plan(common + ["--link-gbps", "0.01"]) == 0
    table = capsys.readouterr().out
    assert "step time" in table and "hidden" in table and "micro-batches:" in table


# ---------------------------------------------------------------- one real check


def _predicted_and_measured_relay_step() -> tuple[float, float, str]:
    """Rates measured here (matmul, EPS; efficiency and per-call cost fitted to a 1-block
    cut at M = 1 and 8), then a 4-block model at M = 2 predicted and timed. The three
    relays are stepped in turn (median of 9 steps each), so that load from elsewhere
    falls on the calibration and the check alike.

    One torch thread, as under ``make test``'s workers: two OpenMP threads on a
    2-core machine that is busy elsewhere run many times slower, and erratically.
    """
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig(layers=4, d_model=128, heads=4, seq_len=64, batch_size=8, micro_batches=2)
        calibration = [replace(cfg, layers=1, micro_batches=m) for m in (1, 8)]
        *times, measured = time_relay_steps([*calibration, cfg], "cpu", steps=9, warmup=1)
        rates = fit_calibration(measure_rates("cpu", cfg, calibrate_steps=False), list(zip(calibration, times)))
        predicted = predict(cfg, rates).step_s
    finally:
        torch.set_num_threads(threads)
    return predicted, measured, (f"predicted {predicted:.4f} s, measured {measured:.4f} s "
                                 f"({predicted / measured - 1:+.1%}); efficiency {rates.efficiency:.2f}, "
                                 f"per call {rates.per_call_s * 1e6:.0f} µs, 1 thread, "
                                 f"{time.perf_counter() - start:.1f} s")


def test_prediction_is_within_30_percent_of_a_real_relay_step():
    """The planner's step time against a real relay step (see the helper). Under ``make test``
    the other worker's load can land on the timed steps and not on the calibration (once in
    about four full runs: -36%); a wrong model misses every time, so a miss is measured
    once more and the test holds the better of the two attempts to 30%."""
    errors = []
    for _ in range(2):
        predicted, measured, line = _predicted_and_measured_relay_step()
        print(line)
        errors.append(abs(predicted / measured - 1))
        if errors[-1] < 0.30:
            break
    assert min(errors) < 0.30, errors


def test_train_prints_the_forecast_beside_the_measured_step(tmp_path):
    """`l2l train` plans the run, then reports measured vs predicted step time and device memory."""
    out = tmp_path / "run"
    r = run_cli("train", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32",
                "--batch-size", "8", "--micro-batches", "2", "--steps", "4", "--eval-every", "0",
                "--eval-batches", "1", "--no-plot", "--plan", "quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "l2l: plan (uncalibrated) predicted: step" in r.stdout
    assert "measured (median)" in r.stdout and "predicted" in r.stdout
    plan = json.loads((out / "summary.json").read_text())["plan"]
    assert plan["predicted_step_s"] > 0 and plan["measured_step_s"] > 0
    # on the CPU the ledger is the device peak, and the planner replays the same ledger
    assert plan["predicted_device_bytes"] == json.loads((out / "summary.json").read_text())["device_peak_bytes"]
    # host memory: the process's predicted peak beside its measured one (tests/test_host_memory.py
    # holds it to 10% on a model whose EPS outweighs the runtime)
    summary = json.loads((out / "summary.json").read_text())
    assert plan["measured_host_peak_bytes"] == summary["host_peak_bytes"] > 0
    assert 0.5 < summary["host_peak_bytes"] / plan["predicted_host_bytes"] < 2
    assert "host peak" in r.stdout


def test_bad_plan_mode_is_one_line(tmp_path):
    r = run_cli("train", "--plan", "psychic", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--plan" in r.stderr and "Traceback" not in r.stderr
