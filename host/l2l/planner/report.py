"""The planner's prediction as people read it: the table of ``l2l plan`` and the one line
``l2l train`` prints before its first step."""
from __future__ import annotations

from ..eps.gather import GATHER_WINDOW
from .model import MicroBatchChoice, Prediction, Rates


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def summary_line(p: Prediction) -> str:
    """One line, to print beside measured figures."""
    return (f"predicted: step {p.step_s:.3f} s ({p.tokens_per_s:,.0f} tok/s; compute {p.compute_s:.3f} s, "
            f"transfer exposed {p.transfer_exposed_s:.3f} s, EPS exposed {p.eps_exposed_s:.3f} s"
            + (f", gathers exposed {p.gather_exposed_s:.3f} s" if p.gather_s else "") + "), "
            f"device {mib(p.device_total_bytes)} (ledger {mib(p.device_ledger_bytes)}, "
            f"weights {mib(p.device_weight_bytes)}), host {mib(p.host_total_bytes)}")


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
         f"{p.dtype_bytes} bytes/element"
         + (f", {c['devices']} workers" if c.get("devices", 1) > 1 else "")
         + (f", {p.machines} machines" if p.machines > 1 else "")),
        f"parameters: {p.params:,} (pre {lp[0]:,}, block {max(lp[1:-1]):,}, post {lp[-1]:,})",
        "rates: compute " + _si(rates.flops_per_s, "FLOP/s") + f" matmul x {rates.efficiency:.2f} efficiency"
        + (f" + {rates.per_call_s * 1e6:.0f} µs per call" if rates.per_call_s else "")
        + ", link " + ("zero-copy" if rates.zero_copy else _si(rates.link_bytes_per_s, "B/s"))
        + ", EPS " + _si(rates.eps_elems_per_s, "elem/s")
        + (f" ({rates.notes['eps_backend']} on {rates.notes['eps_runs_on']})" if rates.notes.get("eps_runs_on") else "")
        + (f"  (measured: {', '.join(rates.notes['measured'])}"
           + ("; calibrated on relay steps" if "calibration" in rates.notes else "") + ")"
           if rates.notes.get("measured") else ""),
        "",
        f"{'step time':<26}{p.step_s:10.3f} s   {p.tokens_per_s:,.0f} tok/s"
        + (" (all machines), " if p.machines > 1 else ", ") + _si(p.flops, "FLOP")
        + (" a machine" if p.machines > 1 else "") + " per step, " + _si(p.achieved_flops_per_s, "FLOP/s")
        + " achieved" + _per_gpu(p, rates),
        (f"{'  compute':<26}{p.compute_s:10.3f} s   forward {p.forward_s:.3f}, post {p.post_s:.3f}, "
         f"recompute+backward {p.backward_s:.3f}"),
        f"{'  link (weights, grads)':<26}{p.transfer_s:10.3f} s   {p.transfer_hidden_share:.0%} hidden, "
        f"exposed {p.transfer_exposed_s:.3f} s" + ("" if not rates.zero_copy else " (zero-copy)"),
    ]
    if p.stash_transfer_s:
        lines.append(f"{'  host stash copies':<26}{p.stash_transfer_s:10.3f} s   synchronous (in compute)")
    lines += [
        f"{'  EPS updates':<26}{p.eps_update_s:10.3f} s   exposed {p.eps_exposed_s:.4f} s"
        + (f", of which collectives {p.collective_s:.3f} s" if p.machines > 1 else ""),
    ]
    if p.gather_s:
        lines.append(f"{'  gathers (copies)':<26}{p.gather_s:10.3f} s   exposed {p.gather_exposed_s:.4f} s, "
                     f"{GATHER_WINDOW} layers ahead of the relay")
    if p.machines > 1:
        moved = (f"gradients {mib(p.exchange_bytes)} + gathers {mib(p.gather_bytes)}" if p.gather_bytes
                 else f"collectives {mib(p.collective_bytes)}")
        lines.append(f"{'  machines':<26}{p.machines:10d}     EPS {p.eps_layout}; {moved} a step, all machines; "
                     "memory below is each machine's")
    lines += [
        "",
        f"{'device memory':<26}{mib(p.device_total_bytes):>14}",
        f"{'  weights + gradients':<26}{mib(p.device_weight_bytes):>14}",
        f"{'  ledger (weights, stash)':<26}{mib(p.device_ledger_bytes):>14}   "
        + ("= device_peak_bytes on the CPU" if rates.zero_copy else "what the relay holds across layers"),
        f"{'  activations (rough)':<26}{mib(p.activation_bytes):>14}   one layer's recompute, one micro-batch",
    ]
    if p.device_backward_extra_bytes:
        lines.append(f"{'  backward temporaries':<26}{mib(p.device_backward_extra_bytes):>14}   "
                     "a layer's weight gradients, and cuBLAS's workspaces")
    lines += [
        f"{'host memory (peak RSS)':<26}{mib(p.host_total_bytes):>14}",
        f"{'  runtime':<26}{mib(p.host_runtime_bytes):>14}   torch and l2l, no model",
        f"{'  EPS state':<26}{mib(p.host_eps_bytes):>14}   " + _state_per_param(p)
        + " bytes/param and 2 layers' inboxes",
        f"{'  transients':<26}{mib(p.host_transient_bytes):>14}   a few layers"
        + (", and the CPU device's stash and activations" if rates.zero_copy else ""),
    ]
    if p.host_gather_bytes:
        lines.append(f"{'  gathered copies':<26}{mib(p.host_gather_bytes):>14}   whole copies of the largest "
                     f"layer: {GATHER_WINDOW} ahead, and the workers'")
    if p.host_stash_bytes:
        lines.append(f"{'  host stash':<26}{mib(p.host_stash_bytes):>14}")
    if choice is not None:
        lines += ["", f"micro-batches: {choice.micro_batches if choice.micro_batches else 'none'} -- {choice.reason}",
                  f"{'M':>5} {'step (s)':>9} {'hidden':>7} {'waits':>6} {'device':>12} {'fits':>5}"]
        for r in choice.candidates:
            lines.append(f"{r['micro_batches']:>5} {r['step_s']:>9.3f} {r['hidden_share']:>7.0%} {r['exposed_share']:>6.1%} "
                         f"{mib(r['device_total_bytes']):>12} {'yes' if r['fits'] else 'no':>5}")
    return "\n".join(lines)


def _state_per_param(p: Prediction) -> str:
    """The state's bytes a parameter as a formula: p, the moments and the copy (1/R of both when sharded)."""
    state = p.eps_state_bytes
    if p.lora_adapter_params:  # LoRA: the adapters' state and the frozen base's bytes, apart
        copy = round((p.host_state_bytes - p.lora_base_bytes) / p.lora_adapter_params) - state
        base = p.lora_base_bytes / p.params if p.params else 0
        return f"{base:g} (frozen base) + {state}{f' + {copy}' if copy else ''} (adapters)"
    copy = round((p.host_state_bytes * (p.machines if p.eps_layout == "sharded" else 1)) / p.params) - state \
        if p.params else 0
    if p.eps_layout != "sharded":
        return f"{state} + {copy}" if copy else f"{state}"
    return f"({state} + {copy})/{p.machines}" if copy else f"{state}/{p.machines}"


def _per_gpu(p: Prediction, rates: Rates) -> str:
    """K GPUs: the achieved rate of one, against its ``--flops`` (the CPU's workers share one rate)."""
    k = p.config.get("devices", 1)
    if rates.zero_copy or k == 1:
        return ""
    return f", {_si(p.achieved_flops_per_s / k, 'FLOP/s')} a GPU"
