"""A pre-imported Python that forks one process per command-line run of the tests.

Every ``python -m l2l`` the tests start imports torch, l2l and often transformers before it
does anything: 3 to 7 CPU-seconds each, hundreds of times a session on a 2-core machine. The
zygote (``python tests/cli_zygote.py``, one per pytest worker) imports them once; for each run
it forks a child that takes the run's working directory, environment, argv and standard
streams, then runs ``l2l/__main__.py`` (or a script) as ``__main__``, exactly as the interpreter
would: exit status from ``SystemExit``, a traceback and status 1 for anything else, non-daemon
threads joined and ``atexit`` run before it exits. The run is still its own process (its own
pid, exit status, signals, file descriptors and heap), so crashes, kills and exit codes are
tested as users meet them.

What differs from a fresh interpreter is only what the zygote imported before the fork: those
modules' import-time state, and the resident memory they hold. Runs that measure their own
resident set, or what a command imports, start a fresh interpreter (``run_cli(fresh=True)``);
``L2L_TEST_FRESH=1`` makes every run fresh (tests/test_cli_zygote.py checks both agree).

Protocol, one JSON object a line over the zygote's stdin/stdout: the request
``{"argv", "cwd", "env", "stdout", "stderr"}`` (argv as given to ``python``: ``["-m", MODULE,
...]`` or ``[SCRIPT, ...]``; stdout/stderr are files to write), answered by ``{"pid"}`` at once
and ``{"returncode"}`` when the run ended (negative: killed by that signal, as subprocess says).
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# What every l2l command imports, transformers (for --model DIR, its tokenizers and export) and
# matplotlib's pyplot (a run's metrics.png; 1.7 s of import), on the Agg backend l2l selects.
PRELOAD = ("torch", "numpy", "safetensors.numpy", "l2l.cli", "l2l.train", "transformers",
           "transformers.models.llama.modeling_llama", "matplotlib")


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter gives ``sys.exit(code)``: None is 0, an int itself, else 1
    after printing it to stderr."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _run_as_main(argv: list[str], cwd: str) -> int:
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in sys.argv[0]
            sys.path[0] = cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: traceback, status 1
        sys.excepthook(*sys.exc_info())
        return 1


def _child(request: dict) -> None:
    """In the forked child: become the requested run, then leave with its status (never returns)."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        _reseed()
        _threads_from(request["env"])
        code = _run_as_main(request["argv"], request["cwd"])
        threading._shutdown()  # noqa: SLF001 - what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()  # noqa: SLF001 - and then runs atexit
    except BaseException:  # noqa: BLE001
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - a closed or broken stream: nothing more to say
                pass
        os._exit(code)


def _reseed() -> None:
    """A fresh interpreter seeds Python's and NumPy's global generators from the OS; forked
    children would all share the zygote's."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _threads_from(env: dict) -> None:
    """OMP_NUM_THREADS is read when the OpenMP runtime loads (in the zygote): a run asking for
    another count gets it the way torch offers."""
    wanted = env.get("OMP_NUM_THREADS")
    if wanted and wanted.isdigit() and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.get_num_threads() != int(wanted):
            torch.set_num_threads(int(wanted))


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    sys.modules["matplotlib"].use("Agg")  # as l2l.metrics.plot_metrics does, before pyplot
    importlib.import_module("matplotlib.pyplot")
    control_in = os.fdopen(os.dup(0), "r")
    control_out = os.fdopen(os.dup(1), "w")
    control_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    control_out.flush()
    for line in control_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            control_in.close()
            control_out.close()
            _child(request)
        control_out.write(json.dumps({"pid": pid}) + "\n")
        control_out.flush()
        _, status = os.waitpid(pid, 0)
        control_out.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        control_out.flush()


class Zygote:
    """The test side: starts ``python tests/cli_zygote.py`` on first use and runs commands
    through it, one at a time; a zygote that died is started again."""

    def __init__(self) -> None:
        self._proc = None
        self._pending = b""
        self._lock = threading.Lock()
        self._scratch = None

    def _start(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env)
        self._pending = b""
        self._scratch = self._scratch or tempfile.mkdtemp(prefix="l2l-zygote-")
        if self._answer(None) is None:
            raise RuntimeError(f"tests/cli_zygote.py did not start (exit status {self._proc.wait()})")

    def _answer(self, timeout: float | None) -> dict | None:
        """The zygote's next line, or None when none came within ``timeout`` seconds (or it died)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], *, env: dict, cwd, timeout: float | None):
        """``python ARGV`` as ``subprocess.run(..., capture_output=True, text=True)`` would give it."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            out, err = os.path.join(self._scratch, "stdout"), os.path.join(self._scratch, "stderr")
            request = {"argv": [str(a) for a in argv], "cwd": os.path.abspath(cwd or os.getcwd()),
                       "env": {str(k): str(v) for k, v in env.items()}, "stdout": out, "stderr": err}
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            pid = self._answer(None)["pid"]
            ended = self._answer(timeout)
            timed_out = ended is None
            if timed_out:
                os.kill(pid, signal.SIGKILL)
                ended = self._answer(None)
            if ended is None:
                raise RuntimeError(f"tests/cli_zygote.py died running {argv}")
            with open(out, encoding="utf-8", newline=None) as f:
                stdout = f.read()
            with open(err, encoding="utf-8", newline=None) as f:
                stderr = f.read()
            args = [sys.executable, *request["argv"]]
            if timed_out:
                raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
            return subprocess.CompletedProcess(args, ended["returncode"], stdout, stderr)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
            self._proc.stdout.close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)


if __name__ == "__main__":
    serve()
