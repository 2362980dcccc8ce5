"""``l2l``: train, inspect, benchmark. User mistakes exit 2 with one line."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from .config import DEVICES, ENGINES, STASH, TrainConfig
from .errors import UserError, PeerLostError
from .hostmem import tune_host_allocator


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (its default prints usage first)."""

    def error(self, message: str):  # noqa: D401
        raise UserError(message)


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="train a model layer by layer (or with the plain baseline)")
    p.add_argument("--model", default=d.model, help="gpt | hf-gpt2 | hf-bert (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (sequences per step)")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="M: the relay runs each layer over M micro-batches (must divide --batch-size)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="length of the cosine schedule (default: --steps)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--beta1", type=float, default=d.beta1)
    p.add_argument("--beta2", type=float, default=d.beta2)
    p.add_argument("--adam-eps", type=float, default=d.adam_eps)
    p.add_argument("--device", default=d.device, help=f"{' | '.join(DEVICES)} (default %(default)s)")
    p.add_argument("--eps", default=d.eps, help="EPS backend: numpy | opencl | hls-csim (default %(default)s; see `l2l info`)")
    p.add_argument("--cl-platform", default=None, help="OpenCL platform: index or name substring (env L2L_CL_PLATFORM)")
    p.add_argument("--cl-device", default=None, help="OpenCL device: index or name substring (env L2L_CL_DEVICE)")
    p.add_argument("--cl-binary", default=None, help="precompiled OpenCL program (.xclbin, .aocx) for the OpenCL EPS")
    p.add_argument("--engine", default=d.engine, help=f"{' | '.join(ENGINES)} (default %(default)s)")
    p.add_argument("--devices", type=int, default=d.devices,
                   help="relay workers in this box, one per GPU (CPU workers without one), all feeding one EPS")
    p.add_argument("--check-every", type=int, default=d.check_every,
                   help="under torchrun: steps between checks that every machine holds the same master weights")
    p.add_argument("--checkpointing", action="store_true", help="plain engine: recompute blocks in backward")
    p.add_argument("--accumulate", action="store_true",
                   help="plain engine: run the batch as --micro-batches micro-batches, accumulating gradients "
                        "(default: the whole batch at once)")
    p.add_argument("--stash", default=d.stash, help=f"{' | '.join(STASH)}: where stashed activations wait")
    p.add_argument("--precision", default=d.precision,
                   help="fp32 | bf16 | fp16: what the device computes in (fp16 with dynamic loss scaling)")
    p.add_argument("--overflow", default=d.overflow,
                   help="eager: an overflowing layer skips its own update (default); strict: updates wait for "
                        "the end of backward and the whole step is applied or skipped, as torch's GradScaler does")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip gradients to this global L2 norm (needs --overflow strict with --engine l2l)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="text file or folder (default: this Python's stdlib sources)")
    p.add_argument("--out", default=None, help="run directory (default runs/MODEL-ENGINE)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation (0: end only)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: end only)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or messages")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--plan", default=None,
                   help="planner forecast printed beside the measured step time: auto (default; calibrates "
                        "when that costs <= 5%% of the run) | calibrated | quick | off")


def _cmd_train(args) -> int:
    from .train import train
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    train(cfg)
    return 0


def _cmd_info(args) -> int:
    from .info import info_lines
    print("\n".join(info_lines()))
    return 0


def _cmd_opencl_binary(args) -> int:
    """Build the EPS kernels for an OpenCL device and save the program binary (what
    --cl-binary loads; FPGA cards get theirs from the vendor compiler instead)."""
    from pathlib import Path

    from .eps.opencl_backend import OpenCLBackend
    backend = OpenCLBackend(platform=args.cl_platform, device=args.cl_device)
    Path(args.out).write_bytes(backend.program_binary())
    print(f"wrote {args.out} for {backend.device.name.strip()} ({Path(args.out).stat().st_size:,} bytes)")
    return 0


def _cmd_bench(args) -> int:
    if args.what == "eps":
        from .bench_eps import run_eps_bench
        return run_eps_bench(args.rest)
    from .bench import run_bench
    return run_bench(args.what, args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="l2l", description="Layer-to-layer training with an eager param-server.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    sub.add_parser("info", help="torch version, devices and the EPS backends usable here")
    o = sub.add_parser("opencl-binary", help="build the OpenCL EPS kernels and save the program binary")
    o.add_argument("--out", required=True, help="file to write (then: l2l train --eps opencl --cl-binary FILE)")
    o.add_argument("--cl-platform", default=None)
    o.add_argument("--cl-device", default=None)
    sub.add_parser("plan", help="predict step time, hidden transfer share and memory before a run "
                                "(options: l2l plan --help)")
    b = sub.add_parser("bench", help="benchmarks: relay (step time vs the plain baseline), eps (update throughput), "
                                     "memory (device memory vs depth and M), workers (1, 2, 4 relay workers on one EPS), "
                                     "suite (eps, relay and memory, with headline figures)")
    b.add_argument("what", nargs="?", default="relay", help="relay (default) | eps | memory | workers | suite")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark (see `l2l bench relay --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tune_host_allocator()
    try:
        if argv[:1] == ["plan"]:  # all of its options are the planner's own (argparse REMAINDER
            from .planner import run_plan  # cannot take a leading --option)
            return run_plan(argv[1:])
        args = build_parser().parse_args(argv)
        handler = {"train": _cmd_train, "info": _cmd_info, "bench": _cmd_bench,
                   "opencl-binary": _cmd_opencl_binary}[args.command]
        return handler(args)
    except UserError as exc:
        print(f"l2l: error: {exc}", file=sys.stderr)
        return 2
    except PeerLostError as exc:  # a distributed run lost a machine: not a bug here, not the user's input
        print(f"l2l: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # disk full, permissions: the environment, not a bug
        print(f"l2l: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("l2l: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
