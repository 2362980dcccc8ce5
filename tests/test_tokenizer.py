"""Tokenizers: bytes, a BPE trained by ``l2l tokenizer train``, and directories transformers wrote.

Everything is made here from text the tests write: no download, no model hub.
"""
from __future__ import annotations

import json
import random

import pytest

from conftest import run_cli
from shared_runs import cli_once
from l2l.errors import UserError
from l2l.data_files import text_files
from l2l.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe

VOCAB = 300
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Über die Brücke gehen naïve Leute ins Café, 日本語のテキスト, emoji 🙂, tabs\tand  double spaces.",
]


def _corpus(root, n_files: int = 3):
    """A folder of a few KB of text, plus the files the --data rules skip."""
    rng = random.Random(0)
    words = ("layer relay param server eager update gradient stash micro batch device host memory "
             "the a of to and in is for Brücke café naïve 日本 🙂").split()
    root.mkdir()
    for i in range(n_files):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(40)]
        (root / f"doc{i}.txt").write_text("\n".join(lines + SENTENCES) + "\n", encoding="utf-8")
    (root / ".hidden.txt").write_text("hidden " * 100)
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("hidden " * 100)
    (root / "blob.bin").write_bytes(b"text\0binary" * 10)
    (root / "empty.txt").write_text("")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the output directory, the command's stdout) of one ``l2l tokenizer train`` run, for the session."""
    def train(out):
        data = _corpus(out.parent / "data")
        return run_cli("tokenizer", "train", "--data", str(data), "--vocab-size", str(VOCAB), "--out", str(out))
    out, r = cli_once(tmp_path_factory, "tokenizer-bpe", train, leaf="bpe")
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("l2l: error: "), r.stderr
    return lines[0]


# -- bytes ---------------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256 and tok.eos_id is None and tok.chat_template is None
    rng = random.Random(1)
    texts = SENTENCES + ["", "\0\x7f\n"] + [
        "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xa0, 0xd800),
                                rng.randrange(0xe000, 0x110000)])) for _ in range(50)) for _ in range(20)]
    for s in texts:
        ids = tok.encode(s)
        assert ids == list(s.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == s
    assert tok.decode([0xff, 65]) == "\ufffdA"  # a model's invalid UTF-8 does not raise


# -- a BPE trained by the CLI ---------------------------------------------------


def test_trained_tokenizer_writes_a_directory_transformers_loads(trained):
    out, stdout = trained
    import transformers
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == EOS_TOKEN
    ours = load_tokenizer(str(out), None)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for s in SENTENCES:
        assert theirs.encode(s) == ours.encode(s)
        assert theirs.decode(ours.encode(s)) == s
    assert theirs.eos_token == EOS_TOKEN and theirs.eos_token_id == ours.eos_id
    assert len(theirs) == ours.vocab_size
    # the summary line: vocab, files (the three docs; hidden, binary, empty skipped), bytes, out dir
    assert stdout.count("\n") == 1
    size = sum(p.stat().st_size for p in (out.parent / "data").glob("doc*.txt"))
    assert f"vocab {VOCAB} (asked {VOCAB})" in stdout and "3 files" in stdout
    assert f"{size:,} bytes" in stdout and str(out) in stdout


def test_trained_tokenizer_round_trips_and_has_its_eos(trained):
    out, _ = trained
    tok = load_tokenizer(str(out), None)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    # the corpus has enough distinct pairs for every merge asked for
    assert tok.vocab_size == VOCAB
    assert tok.eos_token == EOS_TOKEN and tok.eos_id == tok.backend.token_to_id(EOS_TOKEN)
    assert tok.encode(EOS_TOKEN) == [tok.eos_id]
    assert tok.chat_template is None
    for s in SENTENCES + ["plain ASCII only", "  leading spaces", "ÄÖÜ äöü ß €", "🙂🙃 unseen: ℵ ∑ Ω"]:
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s
    assert len(tok.encode(SENTENCES[0])) < len(SENTENCES[0].encode())  # merges were learnt
    assert tok.decode(tok.encode("a") + [tok.eos_id] + tok.encode("b")) == f"a{EOS_TOKEN}b"
    assert str(out) in tok.description and tok.name == "bpe"


def test_load_tokenizer_picks_the_model_directory_tokenizer(trained, tmp_path):
    out, _ = trained
    assert isinstance(load_tokenizer("bytes", str(out)), ByteTokenizer)  # asked for: bytes wins
    assert isinstance(load_tokenizer(None, None), ByteTokenizer)
    assert isinstance(load_tokenizer(None, str(out)), HFTokenizer)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert isinstance(load_tokenizer(None, str(tmp_path / "model")), ByteTokenizer)
    with pytest.raises(UserError, match="model directory not found"):
        load_tokenizer(None, str(tmp_path / "nowhere"))


def test_a_directory_transformers_saved_loads_with_its_chat_template(trained, tmp_path):
    out, _ = trained
    import transformers
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    backend = load_tokenizer(str(out)).backend
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN)
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path / "saved"))
    tok = load_tokenizer(str(tmp_path / "saved"), None)
    assert tok.chat_template == template
    assert tok.eos_id == fast.eos_token_id
    assert tok.encode(SENTENCES[2]) == fast.encode(SENTENCES[2])


def test_older_config_forms_are_read(trained, tmp_path):
    """eos as {"content": ...} in special_tokens_map.json; chat templates as a named list in the config."""
    out, _ = trained
    d = tmp_path / "old"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": EOS_TOKEN}}))
    tok = load_tokenizer(str(d))
    assert tok.chat_template == "D" and tok.eos_token == EOS_TOKEN and tok.eos_id is not None
    (d / "special_tokens_map.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "C"}))
    tok = load_tokenizer(str(d))
    assert tok.chat_template == "C" and tok.eos_id is None and "no eos token" in tok.description


def test_tokenizer_training_and_data_read_the_same_files(tmp_path):
    """One set of --data rules (l2l.data_files): hidden, binary and empty files skipped by both."""
    from l2l.data import load_corpus
    data = _corpus(tmp_path / "data")
    (data / "sub").mkdir()
    (data / "sub" / "more.txt").write_text("more text " * 20)
    files = text_files(data)
    assert [p[len(str(data)) + 1:] for p in files] == ["doc0.txt", "doc1.txt", "doc2.txt", "sub/more.txt"]
    assert load_corpus(str(data)).num_files == len(files)


# -- mistakes -------------------------------------------------------------------


def test_bad_tokenizer_directories_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="tokenizer directory not found: .*nowhere"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no tokenizer.json in tokenizer directory .*empty"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UserError, match="cannot load the tokenizer in .*bad with transformers") as e:
        load_tokenizer(None, str(tmp_path / "bad"))
    assert "\n" not in str(e.value)


def test_train_bpe_refuses_a_small_vocab_and_an_occupied_directory(tmp_path):
    data = tmp_path / "a.txt"
    data.write_text("some text " * 50)
    with pytest.raises(UserError, match="at least 257"):
        train_bpe([str(data)], 256, str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        train_bpe([str(data)], 300, str(tmp_path / "full"))
    (tmp_path / "empty").mkdir()  # an empty directory is taken
    tok = train_bpe([str(data)], 300, str(tmp_path / "empty"))
    assert tok.get_vocab_size() <= 300 and tok.decode(tok.encode("some text").ids) == "some text"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "empty", "full"]  # no temporary left
    assert text_files(str(data)) == [str(data)]


@pytest.mark.parametrize("case", ["missing data", "occupied out", "small vocab", "out is a file"])
def test_cli_mistakes_exit_2_with_one_line(case, tmp_path):
    data = tmp_path / "a.txt"
    data.write_text("some text " * 50)
    out = tmp_path / "out"
    args = ["--data", str(data), "--vocab-size", "300", "--out", str(out)]
    if case == "missing data":
        args[1] = str(tmp_path / "nowhere")
        expect = "data path not found"
    elif case == "occupied out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expect = "not empty"
    elif case == "small vocab":
        args[3] = "200"
        expect = "at least 257"
    else:
        out.write_text("mine")
        expect = "not a directory"
    line = _one_error_line(run_cli("tokenizer", "train", *args))
    assert expect in line
    if case == "occupied out":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    elif case == "out is a file":
        assert out.read_text() == "mine"
    else:
        assert not out.exists()
