"""The tests' command-line runs are forked from a pre-imported interpreter (tests/cli_zygote.py):
each must behave as ``python ...`` started fresh would, or every CLI test would be testing
something users never run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap

import pytest

from conftest import run_cli, run_python
from test_train_cli import TINY

PROBE = textwrap.dedent("""
    import atexit, json, os, random, sys, threading, time
    import numpy as np

    def late():  # a non-daemon thread: the interpreter waits for it, then runs atexit
        time.sleep(0.2)
        print("thread done", flush=True)

    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran"))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "mine": os.environ.get("MINE"),
                      "gone": "L2L_TEST_GONE" in os.environ, "pid": os.getpid(), "random": random.random(),
                      "numpy": float(np.random.random()), "main": __name__}))
    if len(sys.argv) > 1 and sys.argv[1] == "raise":
        raise ValueError("the probe's own error")
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else None)
""")


@pytest.fixture()
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _seen(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout.splitlines()[0])


def test_a_run_gets_its_argv_cwd_environment_and_exit_status(probe, tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_TEST_GONE", "1")
    work = tmp_path / "work"
    work.mkdir()
    runs = [run_python(str(probe), "7", cwd=work, env={"MINE": "yes"}, fresh=fresh) for fresh in (False, True)]
    forked, fresh = (_seen(r) for r in runs)
    for r, seen in zip(runs, (forked, fresh)):
        assert r.returncode == 7
        assert r.stdout.splitlines()[1:] == ["thread done", "atexit ran"]
        assert seen["argv"] == [str(probe), "7"] and seen["cwd"] == str(work) and seen["mine"] == "yes"
        assert seen["path0"] == str(tmp_path) and seen["main"] == "__main__"
        assert seen["gone"]  # the test's own environment is inherited, as subprocess does
    assert forked["pid"] != os.getpid() and forked["pid"] != fresh["pid"]
    again = _seen(run_python(str(probe), cwd=work))
    assert again["random"] != forked["random"] and again["numpy"] != forked["numpy"]  # reseeded per run


def test_an_uncaught_error_is_a_traceback_and_status_1(probe):
    for fresh in (False, True):
        r = run_python(str(probe), "raise", fresh=fresh)
        assert r.returncode == 1
        assert r.stderr.startswith("Traceback") and r.stderr.rstrip().endswith("ValueError: the probe's own error")


def test_a_run_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_python(str(script), timeout=2)
    pid = int(caught.value.output.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    (tmp_path / "next.py").write_text("print('served')\n")
    assert run_python(str(tmp_path / "next.py")).stdout == "served\n"  # the zygote serves on


def test_the_command_line_gives_the_same_run_forked_or_fresh(tmp_path):
    """One tiny training run both ways: the same losses bit for bit, the same death by SIGKILL."""
    runs = {}
    for fresh in (False, True):
        out = tmp_path / f"fresh-{fresh}"
        r = run_cli("train", *TINY, "--steps", "2", "--no-progress", "--out", str(out), fresh=fresh)
        assert r.returncode == 0, r.stderr
        runs[fresh] = (out / "metrics.jsonl").read_text().splitlines()
        killed = run_cli("train", *TINY, "--steps", "3", "--no-progress", "--out", str(tmp_path / f"killed-{fresh}"),
                         fault=("kill-at-step", 1), fresh=fresh)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    losses = [[json.loads(line)["loss"] for line in lines if '"loss"' in line] for lines in runs.values()]
    assert losses[0] == losses[1] and len(losses[0]) == 2
