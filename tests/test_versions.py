"""The dependency ranges l2l declares: the floors make test-oldest installs, and the
transformers it accepts (refused in one line outside the range, its dtype keyword inside)."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
import torch

import floors
from l2l.models.hf_version import declared_range, dtype_kwarg

from conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_floors_pin_each_runtime_dependency_and_the_hf_and_opencl_extras_at_their_lower_bounds():
    pins = dict(p.split("==") for p in floors.floors())
    extras = PROJECT["optional-dependencies"]
    declared = [*PROJECT["dependencies"], *extras["hf"], *extras["opencl"]]
    assert {r.split(">=")[0] for r in declared} <= set(pins), pins
    assert pins["torch"] == "2.4" and pins["transformers"] == str(declared_range()).removeprefix(">=")
    assert {"pytest", "pytest-xdist"} <= set(pins)


def test_a_requirement_without_a_floor_or_with_two_floors_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no '>=' floor"):
        floors.pin("torch<3")
    twice = tmp_path / "pyproject.toml"
    twice.write_text('[project]\ndependencies = ["numpy>=1.24"]\n'
                     '[project.optional-dependencies]\nhf = ["numpy>=1.26"]\nopencl = []\ntest = []\n')
    with pytest.raises(ValueError, match="two floors"):
        floors.floors(twice)


def test_the_test_extra_asks_for_the_transformers_the_hf_extra_does():
    def transformers_of(extra):
        return [r for r in PROJECT["optional-dependencies"][extra] if r.startswith("transformers")]
    assert transformers_of("test") == transformers_of("hf") == [f"transformers{declared_range()}"]


def test_from_config_builds_in_the_dtype_asked_without_a_deprecation_warning(caplog):
    """The keyword is ``torch_dtype`` before transformers 4.56 and ``dtype`` from then on;
    make test-oldest runs this at the floor, make test at the newest."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **dtype_kwarg(torch.float64))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert "deprecated" not in caplog.text


def test_a_transformers_older_than_the_floor_is_refused_in_one_line(tmp_path):
    """As a user with an old transformers runs `l2l train --model DIR`: the installed
    transformers reports a version below the declared range."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    argv = ["train", "--model", str(tmp_path / "llama"), "--steps", "1", "--seq-len", "8", "--batch-size", "2",
            "--micro-batches", "1", "--out", str(tmp_path / "run")]
    code = ("import sys, transformers; transformers.__version__ = '4.40.2'\n"
            f"from l2l.cli import main; sys.exit(main({json.dumps(argv)}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"l2l: error: l2l needs transformers{declared_range()}, this environment has 4.40.2: "
        f"pip install 'transformers{declared_range()}'"]
    assert not (tmp_path / "run").exists()
