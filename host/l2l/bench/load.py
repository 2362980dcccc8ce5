"""``l2l bench load``: host memory of loading a Hugging Face checkpoint into the EPS.

A Llama-shaped checkpoint of about ``--params`` parameters (untied embeddings,
random weights, saved with transformers' ``save_pretrained`` as safetensors at
its default shard size) is generated once into ``--checkpoint`` and reused while
its shape matches. A fresh process then loads it the way ``l2l train --model DIR``
does -- the stack on the meta device, each layer read from the safetensors files
into the EPS in turn -- and reports the resident set (``/proc/self/status``):
before the load (after the imports), its peak during the load (``VmHWM``, reset
by writing 5 to ``/proc/self/clear_refs``) and after it, against the EPS state
(fp32 p, m, v and the device copy: 12 bytes a parameter plus 4 in fp32, 2 in
bf16/fp16). The aim (issue 14): the load's peak above the baseline stays within
the EPS state plus 1 GiB. Then ``--steps`` training steps on random byte tokens,
their times and the peak resident set while they run.

Generation and measurement each run in a subprocess of their own, so neither
the generator's memory nor this process's imports pollute the figures.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UserError
from ..hostmem import memory_status, reset_peak_resident
from ..options import Parser
from .output import save_results

GIB = 1 << 30
MARKER = "l2l-bench-load.json"  # written last: the checkpoint is complete and its shape is this
# Llama shapes, largest first: the first whose embeddings and four blocks fit the target is
# used, with as many blocks as bring the total nearest to it.
SHAPES = (
    {"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_attention_heads": 12,
     "num_key_value_heads": 4},
    {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
     "num_key_value_heads": 4},
    {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
     "num_key_value_heads": 2},
)
DTYPES = ("bf16", "fp32")


def _counts(shape: dict) -> tuple[int, int]:
    """(parameters outside the blocks, parameters of one block) of an untied Llama."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * v * h + h, 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def llama_shape(params: float) -> dict:
    """The Llama config (as keyword arguments) nearest ``params`` parameters, and its exact count."""
    for shape in SHAPES:
        fixed, block = _counts(shape)
        if fixed + 4 * block <= params:
            break
    layers = max(1, round((params - fixed) / block))
    return {**shape, "num_hidden_layers": layers, "tie_word_embeddings": False,
            "params": fixed + layers * block}


# ------------------------------------------------------------ subprocesses
def _generate(spec: dict, target: str) -> dict:
    """Build the model, save it into ``target``, free it; the process's peak resident set."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..models.hf_version import dtype_kwarg

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(**{k: v for k, v in spec.items() if k not in ("params", "dtype", "seed",
                                                                        "max_shard_size")})
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["dtype"]]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, **dtype_kwarg(dtype))
    numel = sum(p.numel() for p in model.parameters())
    if numel != spec["params"]:
        raise RuntimeError(f"the model has {numel} parameters, expected {spec['params']}")
    kwargs = {"max_shard_size": spec["max_shard_size"]} if spec["max_shard_size"] else {}
    model.save_pretrained(target, **kwargs)
    del model
    (Path(target) / MARKER).write_text(json.dumps(spec, indent=2) + "\n")
    return {"generate_s": time.perf_counter() - t0, "generate_peak_rss": memory_status()["VmHWM"],
            "model_bytes": numel * dtype.itemsize}


def _measure(opts: dict) -> dict:
    """Load the checkpoint into a relay engine's EPS, then train ``steps`` steps; resident sets."""
    from ..hostmem import tune_host_allocator
    tuned = tune_host_allocator()  # as the l2l command does before it trains
    import torch

    from ..build import build_engine
    from ..config import TrainConfig
    from ..data import Batch
    from ..models import ModelConfig, build_stack

    out: dict = {"malloc_tuned": tuned, "rss_start": memory_status()["VmRSS"]}
    # the imports a load needs, before the baseline: they cost the same for any model size
    for module in ("safetensors", "transformers", "transformers.models.llama.modeling_llama"):
        importlib.import_module(module)
    before = memory_status()
    out["rss_before"] = before["VmRSS"]
    out["hwm_reset"] = reset_peak_resident()
    t0 = time.perf_counter()
    cfg = TrainConfig(model=opts["checkpoint"], seq_len=opts["seq_len"], batch_size=opts["batch_size"],
                      micro_batches=opts["micro_batches"], eps=opts["eps"], precision=opts["precision"],
                      device="cpu", progress=False).check()
    stack = build_stack(ModelConfig(family=opts["checkpoint"], seq_len=opts["seq_len"]), 0)
    out["rss_stack"] = memory_status()["VmRSS"]
    engine = build_engine(cfg, stack, torch.device("cpu"))
    out["load_s"] = time.perf_counter() - t0
    after = memory_status()
    out.update(rss_after_load=after["VmRSS"], peak_load=after["VmHWM"], rss_anon_after_load=after["RssAnon"],
               rss_file_after_load=after["RssFile"])
    eps = engine.eps
    out["params"] = sum(eps.numel(i) for i in eps.layers)
    out["copy_bytes"] = eps.copy_dtype.itemsize
    out["eps_state_bytes"] = sum(eps.numel(i) * (eps.optimizer.state_bytes + eps.copy_dtype.itemsize) for i in eps.layers)
    out["layers"] = len(eps.layers)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (opts["batch_size"], opts["seq_len"] + 1), generator=g)
    batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    reset_peak_resident()
    times, losses = [], []
    for step in range(opts["steps"]):
        t = time.perf_counter()
        losses.append(engine.train_step(batch, step).loss)
        eps.synchronize()  # the step's eager updates included
        times.append(time.perf_counter() - t)
    end = memory_status()
    out.update(step_s=times, losses=losses, peak_train=end["VmHWM"], rss_after_train=end["VmRSS"])
    engine.close()
    return out


def _child(mode: str, payload: dict, timeout: float) -> dict:
    """Run ``mode`` of this module in a fresh Python; its JSON answer."""
    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "answer.json"
        env = dict(os.environ)
        host = str(Path(__file__).resolve().parents[2])  # the folder holding the l2l package
        env["PYTHONPATH"] = os.pathsep.join([host] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        r = subprocess.run([sys.executable, "-m", "l2l.bench.load", mode, json.dumps(payload), str(answer)],
                           env=env, timeout=timeout)
        if r.returncode != 0:
            raise UserError(f"l2l bench load: the {mode} subprocess failed (exit {r.returncode}; see above)")
        return json.loads(answer.read_text())


def ensure_checkpoint(folder: Path, spec: dict) -> dict | None:
    """Generate the checkpoint of ``spec`` into ``folder`` unless it is there already;
    the generation's figures, or None when the cached one was used."""
    marker = folder / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == spec:
                return None
        except json.JSONDecodeError:
            pass
        print(f"{folder}: a checkpoint of another shape; generating it again", flush=True)
        shutil.rmtree(folder)
    elif folder.exists() and any(folder.iterdir()):
        raise UserError(f"--checkpoint {folder}: a folder this benchmark did not make (no {MARKER}); "
                        "choose an empty or new folder")
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"generating a {spec['params'] / 1e6:.0f}M-parameter Llama ({spec['num_hidden_layers']} blocks, "
          f"hidden {spec['hidden_size']}, {spec['dtype']}) into {folder}", flush=True)
    result = _child("generate", {"spec": spec, "target": str(partial)}, timeout=3600)
    if folder.exists():
        folder.rmdir()  # empty (checked above)
    partial.rename(folder)
    return result


# --------------------------------------------------------------- report
def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def markdown(result: dict) -> str:
    c, m = result["config"], result["measure"]
    load = m["peak_load"] - m["rss_before"]
    steps = ", ".join(f"{t:.2f}" for t in m["step_s"])
    head = (f"Llama, {m['params'] / 1e6:.1f}M parameters ({c['layers']} blocks, hidden {c['hidden']}, "
            f"intermediate {c['intermediate']}, vocab {c['vocab']}, untied embeddings), checkpoint in "
            f"{c['dtype']} ({c['files']}), EPS {c['eps']} with {c['precision']} device copies; "
            f"{c['cores']} CPU cores, torch {c['torch']}, transformers {c['transformers']}; "
            f"glibc malloc tuning {'on' if m['malloc_tuned'] else 'off'}. "
            f"Peaks are VmHWM, reset between phases; the baseline is the resident set after the imports "
            f"({_gib(m['rss_before'])}; {_gib(m['rss_start'])} before transformers was imported).\n\n"
            f"Command: `{result['command']}`\n\n")
    rows = [
        ("EPS state (p, m, v, device copy)", _gib(m["eps_state_bytes"])),
        ("peak during load - baseline", _gib(load)),
        ("peak during load / EPS state", f"{load / m['eps_state_bytes']:.3f}"),
        ("aim: EPS state + 1 GiB", f"{_gib(m['eps_state_bytes'] + GIB)}: "
                                   f"{'met' if result['aim_met'] else 'NOT met'}"),
        ("resident after load - baseline", _gib(m["rss_after_load"] - m["rss_before"])),
        ("load time", f"{m['load_s']:.1f} s"),
        (f"training steps ({c['batch_size']} x {c['seq_len']} tokens, M={c['micro_batches']})", f"{steps} s"),
        ("peak during training - baseline", _gib(m["peak_train"] - m["rss_before"])),
    ]
    return head + "| | |\n|---|---:|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _parser():
    p = Parser(prog="l2l bench load", description=__doc__)
    p.add_argument("--params", type=float, default=500e6, help="parameters of the generated Llama "
                   "(default %(default).0f)")
    p.add_argument("--checkpoint", default="bench/results/llama-500m",
                   help="folder of the generated checkpoint, reused while its shape matches (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="the checkpoint's weights (default %(default)s)")
    p.add_argument("--max-shard-size", default=None, help="save_pretrained's shard size (default: its own)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step (default %(default)s)")
    p.add_argument("--micro-batches", type=int, default=2, help="M (default %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="training steps timed after the load (default %(default)s)")
    p.add_argument("--eps", default="numpy", help="EPS backend (default %(default)s)")
    p.add_argument("--precision", default="fp32", help="device precision: the EPS copy's dtype (default %(default)s)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and Markdown results")
    return p


def run_load_bench(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise UserError("l2l bench load reads /proc/self/status: Linux only")
    if args.params < 1e5:
        raise UserError(f"--params {args.params:g}: too small, use at least 1e5")
    shape = llama_shape(args.params)
    spec = {**shape, "dtype": args.dtype, "seed": 0, "max_shard_size": args.max_shard_size}
    folder = Path(args.checkpoint)
    generated = ensure_checkpoint(folder, spec)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    measure = _child("measure", {"checkpoint": str(folder), "seq_len": args.seq_len, "batch_size": args.batch_size,
                                 "micro_batches": args.micro_batches, "steps": args.steps, "eps": args.eps,
                                 "precision": args.precision}, timeout=7200)
    import torch
    import transformers
    config = {"params": shape["params"], "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
              "intermediate": shape["intermediate_size"], "vocab": shape["vocab_size"],
              "heads": shape["num_attention_heads"], "kv_heads": shape["num_key_value_heads"],
              "dtype": args.dtype, "files": f"{len(files)} safetensors file{'s' if len(files) != 1 else ''}",
              "checkpoint_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
              "eps": args.eps, "precision": args.precision, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "micro_batches": args.micro_batches,
              "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__}
    load = measure["peak_load"] - measure["rss_before"]
    result = {"command": " ".join(["l2l bench load", *argv]), "config": config, "generation": generated,
              "measure": measure, "load_above_baseline": load,
              "load_over_eps_state": load / measure["eps_state_bytes"],
              "aim_bytes": measure["eps_state_bytes"] + GIB,
              "aim_met": load <= measure["eps_state_bytes"] + GIB}
    save_results(args.out, "bench_load", result, markdown(result))
    return 0


def main(argv: list[str]) -> int:
    """The subprocesses: ``generate SPEC ANSWER`` and ``measure OPTIONS ANSWER`` (JSON in, JSON out)."""
    mode, payload, answer = argv
    payload = json.loads(payload)
    result = _generate(payload["spec"], payload["target"]) if mode == "generate" else _measure(payload)
    Path(answer).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
