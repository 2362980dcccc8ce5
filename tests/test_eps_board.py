"""``--eps board``: the host driver of the FPGA board (host/l2l/eps/board_backend.py) against a
simulated SoC (host/l2l/eps/board_sim.py): Etherbone over real UDP on the loopback, LiteX's
packet codec on both sides, the SoC's memory map, and the Verilog kernel in Verilator behind
it. The board's answers come from the RTL, not from a mock; the runs are the NumPy EPS's bits.

The simulator serves on 127.0.0.2 and the driver listens on 127.0.0.1 at the same port number,
as a board and its host do on two machines (LiteEth answers at its own port).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from l2l.eps import BoardBackend, NumpyBackend, OptimizerHyper, board_map, kernel_regs
from l2l.eps.board_backend import Dram
from l2l.eps.contract import step_scalars
from l2l.eps.etherbone import EtherboneLink
from l2l.eps.numerics import as_step
from l2l.eps.rtl_backend import find_tools
from l2l.errors import UserError

from conftest import ROOT, run_cli
from shared_runs import bits, cli_once, run_losses as _losses, same_run as _same_run

sys.path.insert(0, str(ROOT / "sim"))
from tb_eps_kernel import register_map  # noqa: E402

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--micro-batches", "2", "--eval-batches", "1", "--no-progress", "--eval-every", "0"]


def _missing() -> str | None:
    try:
        find_tools()
        import litex.tools.remote.etherbone  # noqa: F401
    except (UserError, ImportError) as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


class Sim:
    """``python -m l2l.eps.board_sim`` as a child process, on a free port of 127.0.0.2."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "l2l.eps.board_sim", "--listen", "127.0.0.2:0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # the model is built by make rtl-models: seconds
        found = re.search(r"udp://127\.0\.0\.2:(\d+)", line)
        if found is None:
            self.proc.kill()
            raise RuntimeError(f"the board simulator did not start: {line}{self.proc.stderr.read()}")
        self.port = int(found.group(1))
        self.url = f"udp://127.0.0.2:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def sim():
    s = Sim()
    yield s
    s.close()


def _steps(backend, ref, n: int, steps: int, k: int, inf_at: int | None = None) -> None:
    """``steps`` updates of one layer on both backends: the same flags, copies and state bits."""
    rng = np.random.default_rng(n)
    p = rng.standard_normal(n, dtype=np.float32)
    backend.allocate(0, p)
    ref.allocate(0, p)
    hyper = OptimizerHyper(weight_decay=0.1)
    for s in range(1, steps + 1):
        grads = rng.standard_normal((k, n), dtype=np.float32)
        if s == inf_at:
            grads[k - 1, n // 2] = np.inf
        scalars = as_step(step_scalars(hyper, s, divisor=float(k)), n)
        got, want = np.full(n, -1, np.float32), np.full(n, -1, np.float32)
        finite = backend.step(0, grads, scalars, got, n_decay=n * 2 // 3)
        assert finite == ref.step(0, grads, scalars, want, n_decay=n * 2 // 3) == (s != inf_at)
        assert np.array_equal(bits(got), bits(want))
    for a, b in zip(backend.read_state(0), ref.read_state(0)):
        assert np.array_equal(bits(a), bits(b))


# ------------------------------------------------------------------ the map and the link

def test_the_drivers_register_map_is_the_rtls():
    """kernel_regs (both drivers' map) against the localparams of fpga/rtl/l2l_axil_ctrl.v."""
    rtl = register_map()
    for name, reg in kernel_regs.BUFFER_REGS.items():
        assert rtl[name] == reg, name
    assert (rtl["n"], rtl["k"], rtl["n_decay"], rtl["decay"]) == (
        kernel_regs.REG_N, kernel_regs.REG_K, kernel_regs.REG_N_DECAY, kernel_regs.REG_SCALARS)
    assert rtl["inv_scale"] == kernel_regs.REG_SCALARS + 4 * 8
    text = (ROOT / "fpga" / "rtl" / "l2l_axil_ctrl.v").read_text()
    for name in ("CTRL", "GIE", "IER", "ISR", "STATUS"):
        found = re.search(rf"localparam\s*\[7:0\]\s*REG_{name}\s*=\s*8'h([0-9A-Fa-f]+)", text)
        assert int(found.group(1), 16) == getattr(kernel_regs, f"REG_{name}"), name
    for name, reg in kernel_regs.LAMB_REGS.items():
        found = re.search(rf"localparam\s*\[7:0\]\s*LAMB_ADDR_{name.upper()}\s*=\s*8'h([0-9A-Fa-f]+)", text)
        assert int(found.group(1), 16) == reg, name


def test_the_link_reads_what_it_wrote_across_records(sim):
    """Writes and reads of more words than one record holds (255), at DRAM addresses; the
    identifier reads as the SoC's."""
    link = EtherboneLink("127.0.0.2", sim.port)
    try:
        link.probe()
        words = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint32)
        stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # not Etherbone: ignored, not a crash
        stray.sendto(b"\x00\x01junk", link.sock.getsockname())
        stray.close()
        link.write_verified(board_map.DRAM_BASE + 4096, words)
        assert np.array_equal(link.read(board_map.DRAM_BASE + 4096, 1000), words)
        assert np.array_equal(link.read(board_map.DRAM_BASE + 4096 + 4 * 300, 3), words[300:303])
        ident = bytes(int(w) for w in link.read(board_map.IDENT_ADDR, board_map.IDENT_WORDS)).split(b"\0")[0]
        assert ident.decode() == board_map.ident("ecpix5", 1)
        assert link.resent == 0
    finally:
        link.close()


# ------------------------------------------------------------------ the backend

def test_board_updates_are_numpysbits(sim):
    """K = 1 and 2 contributions, weight decay on a prefix, a skipped update (an inf in one
    contribution: the kernel's own check writes flag 0 and leaves the layer as it was)."""
    board = BoardBackend(sim.url)
    try:
        assert board.board == "ecpix5" and board.lanes == 1
        assert board.describe().startswith(f"the ecpix5 board at {sim.url}")
        _steps(board, NumpyBackend(), n=3001, steps=3, k=2, inf_at=2)
        board.write_state(0, *(a + np.float32(1) for a in board.read_state(0)))  # a checkpoint's load
        ref = NumpyBackend()
        ref.allocate(0, np.zeros(3001, np.float32))
        ref.write_state(0, *board.read_state(0))
        copy, want = np.empty(3001, np.float32), np.empty(3001, np.float32)
        board.write_copy(0, copy)
        ref.write_copy(0, want)
        assert np.array_equal(bits(copy), bits(want))
    finally:
        board.close()


def test_a_lossy_link_changes_nothing():
    """3% of the datagrams dropped, either way: reads are retried, writes verified, lost starts
    sent again, and the updates are still the NumPy EPS's bits."""
    lossy = Sim("--drop", "0.03")
    try:
        board = BoardBackend(lossy.url, timeout_s=0.1)
        try:
            _steps(board, NumpyBackend(), n=4000, steps=3, k=1, inf_at=3)
            assert board.link.resent > 0  # the loss was there, and was made good
        finally:
            board.close()
    finally:
        lossy.close()


def test_the_drams_size_bounds_the_model_in_one_line():
    dram = Dram(board_map.DRAM_BASE, 1 << 20, "butterstick")
    assert dram.take(10, "a") == board_map.DRAM_BASE and dram.take(4, "b") == board_map.DRAM_BASE + 4096
    with pytest.raises(UserError, match="does not fit the butterstick's 1 MiB of DRAM"):
        dram.take(1 << 20, "layer 3")


# ------------------------------------------------------------------ training runs from the command line

@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    ref, r = cli_once(tmp_path_factory, "eps_board-numpy",
                      lambda out: run_cli("train", *TINY, "--steps", "4", "--eps", "numpy", "--out", str(out)))
    assert r.returncode == 0, r.stderr
    return ref


@pytest.mark.heavy
def test_cli_board_run_is_the_numpy_run_and_resumes(tmp_path, sim, numpy_run):
    """``l2l train --eps board --board-url ...`` for 2 steps of a 4-step schedule, then --resume to
    4 (the state written back to the board from the checkpoint): the NumPy run's losses and bits."""
    run = tmp_path / "board"
    r = run_cli("train", *TINY, "--steps", "2", "--schedule-steps", "4", "--eps", "board", "--board-url", sim.url,
                "--out", str(run))
    assert r.returncode == 0, r.stderr
    eps = json.loads((run / "summary.json").read_text())["eps"]
    assert eps["backend"] == "board" and eps["runs_on"].startswith("the ecpix5 board at udp://127.0.0.2:"), eps
    assert _losses(run) == _losses(numpy_run)[:2]
    r = run_cli("train", *TINY, "--steps", "4", "--resume", "--eps", "board", "--board-url", sim.url,
                "--out", str(run))
    assert r.returncode == 0, r.stderr
    _same_run(numpy_run, run)


@pytest.mark.heavy
def test_cli_board_with_two_workers(tmp_path, sim):
    """--devices 2: each update takes K = 2 contributions on the board."""
    args = (*TINY, "--steps", "2", "--devices", "2")
    for eps in ("numpy", "board"):
        extra = ("--board-url", sim.url) if eps == "board" else ()
        r = run_cli("train", *args, "--eps", eps, *extra, "--out", str(tmp_path / eps))
        assert r.returncode == 0, r.stderr
    _same_run(tmp_path / "numpy", tmp_path / "board")


def test_cli_mistakes_are_one_line(tmp_path):
    """No board there, a malformed address, and what the bitstream's kernel does not run: one
    line each, exit 2, nothing trained."""
    cases = [
        (["--eps", "board"], "--eps board needs --board-url"),
        (["--board-url", "udp://127.0.0.2:1234"], "add --eps board"),
        (["--eps", "board", "--board-url", "http://10.0.0.1"], "expected udp://HOST[:PORT]"),
        (["--eps", "board", "--board-url", "udp://127.0.0.2:1", "--precision", "bf16"], "fp32 gradients and copies"),
        (["--eps", "board", "--board-url", "udp://127.0.0.2:1", "--optimizer", "lion"], "runs AdamW"),
    ]
    for args, says in cases:
        r = run_cli("train", *TINY, "--steps", "1", *args, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    started = time.monotonic()
    r = run_cli("train", *TINY, "--steps", "1", "--eps", "board", "--board-url", "udp://127.0.0.2:9",
                "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "no board answers there" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "y" / "metrics.jsonl").exists()


def test_the_simulators_bench_prints_the_kernels_clocks():
    """``python -m l2l.eps.board_sim --bench`` (the figure docs/fpga.md quotes): one update at K = 1
    and 2 through the driver; the kernel's clocks an element grow with K (each contribution is
    read), and an element costs at least a clock at LANES 1."""
    r = subprocess.run([sys.executable, "-m", "l2l.eps.board_sim", "--bench", "--numel", "16384"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    clocks = [float(x) for x in re.findall(r"K=\d, n=16384: ([\d.]+) kernel clocks an element", r.stdout)]
    assert len(clocks) == 2 and 1.0 <= clocks[0] < clocks[1] < 16, r.stdout
