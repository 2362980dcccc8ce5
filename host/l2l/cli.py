"""``l2l``: train, inspect, benchmark. User mistakes exit 2 with one line."""
from __future__ import annotations

import argparse
import sys

from .errors import PeerLostError, UserError
from .hostmem import record_runtime_resident, tune_host_allocator
from .options import EPS, TRAIN, Parser, add_options, config_from


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model layer by layer (or with the plain baseline)")
    add_options(p, TRAIN)


def _cmd_train(args) -> int:
    from .train import train
    train(config_from(args))
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


def _cmd_tokenizer(args) -> int:
    """``l2l tokenizer train``: a byte-level BPE on a text file or folder (the rules of --data)."""
    import os

    from .data_files import text_files
    from .tokenizer import EOS_TOKEN, train_bpe
    files = text_files(args.data)
    tok = train_bpe(files, args.vocab_size, args.out)
    size = sum(os.path.getsize(f) for f in files)
    print(f"tokenizer: vocab {tok.get_vocab_size():,} (asked {args.vocab_size:,}), eos {EOS_TOKEN} "
          f"(id {tok.token_to_id(EOS_TOKEN)}), {len(files)} file{'s' if len(files) != 1 else ''}, {size:,} bytes "
          f"-> {args.out}")
    return 0


def _cmd_export(args) -> int:
    from .export import export
    from .lora.export import export_lora, is_lora_run
    if is_lora_run(args.run):
        out = export_lora(args.run, args.out, dtype=args.dtype, model=args.model, merge=args.merge)
    elif args.merge:
        raise UserError(f"--merge merges LoRA adapters into their base: {args.run} is not a LoRA run")
    else:
        out = export(args.run, args.out, dtype=args.dtype, model=args.model)
    print(f"wrote {out} from the latest checkpoint of {args.run} ({args.dtype})")
    return 0


def _cmd_bench(args) -> int:
    from .bench import run_bench
    return run_bench(args.what, args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="l2l", description="Layer-to-layer training with an eager param-server.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _train_parser(sub)
    sub.add_parser("info", help="torch version, devices and the EPS backends usable here")
    o = sub.add_parser("opencl-binary", help="build the OpenCL EPS kernels and save the program binary")
    o.add_argument("--out", required=True, help="file to write (then: l2l train --eps opencl --cl-binary FILE)")
    add_options(o, [opt for opt in EPS if opt.flag in ("--cl-platform", "--cl-device")])
    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (l2l tokenizer train --help)")
    t_sub = t.add_subparsers(dest="action", required=True, parser_class=Parser)
    tt = t_sub.add_parser("train", help="train a byte-level BPE with <|endoftext|> on text; write a Hugging Face "
                                        "tokenizer directory")
    tt.add_argument("--data", required=True, metavar="PATH",
                    help="a text file, or a folder (its files as for l2l train --data)")
    tt.add_argument("--vocab-size", required=True, type=int, metavar="N",
                    help="ids in all, at least 257 (256 bytes and <|endoftext|>); the trainer may stop below it")
    tt.add_argument("--out", required=True, metavar="DIR", help="directory to write; must not exist or be empty")
    e = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face model directory")
    e.add_argument("run", help="the run directory (l2l train --out)")
    e.add_argument("--out", required=True, help="the model directory to write (must not exist, or be empty)")
    e.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16: the exported weights' dtype (default fp32)")
    e.add_argument("--model", default=None, help="the model directory the run trained, for its config and "
                   "tokenizer (default: the run's own copy of them, RUN/model); a LoRA run's --merge: its base weights")
    e.add_argument("--merge", action="store_true", help="a LoRA run: the base with the adapters merged, as a "
                   "Hugging Face model directory (default: a PEFT adapter directory)")
    sub.add_parser("plan", help="predict step time, hidden transfer share and memory before a run "
                                "(options: l2l plan --help)")
    b = sub.add_parser("bench", help="benchmarks: relay (step time vs the plain baseline), eps (update throughput), "
                                     "memory (device memory vs depth and M), workers (1, 2, 4 relay workers on one EPS), "
                                     "load (host memory of loading a checkpoint), host (host memory of whole runs vs the planner), suite (eps, relay and memory, with headline figures)")
    b.add_argument("what", nargs="?", default="relay", help="relay (default) | eps | memory | workers | load | host | suite")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark (see `l2l bench relay --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tune_host_allocator()
    record_runtime_resident()  # before any model: the planner's fixed host cost
    try:
        if argv[:1] == ["plan"]:  # all of its options are the planner's own (argparse REMAINDER
            from .planner.command import run_plan  # cannot take a leading --option)
            return run_plan(argv[1:])
        args = build_parser().parse_args(argv)
        handler = {"train": _cmd_train, "info": _cmd_info, "bench": _cmd_bench, "export": _cmd_export,
                   "opencl-binary": _cmd_opencl_binary, "tokenizer": _cmd_tokenizer}[args.command]
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
