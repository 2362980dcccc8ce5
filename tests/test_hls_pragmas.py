"""hls/eps_kernels.cpp is shaped for synthesis: what a Vitis build needs to stream, read off the source.

No Vitis here, so nothing checks the schedule a synthesis would reach. What can
be checked is that the directives asking for it are all there, and each check
is itself tested by removing one directive from the source and seeing it fail:

- every m_axi port of every top function, as the C preprocessor expands the
  interface macros (what Vitis reads), has its own bundle, offset=slave, burst
  lengths for reads and writes and a depth= for co-simulation;
- every kernel reaches a dataflow region; every region is canonical (FIFO
  declarations, each with a STREAM depth, then process calls), each FIFO has
  one writer and one reader, and the processes include reads, computation and
  writes;
- every loop is labelled and has a trip count (min <= avg <= max), every
  innermost loop is pipelined at II=1 or unrolled, and no outer loop is
  pipelined;
- LAMB's lane sums (the one loop that carries a value from one element to a
  later one) keep LANES accumulators completely partitioned and declare the
  true dependence at distance LANES that lets the loop start an element per
  clock; each accumulator is indexed by the element's position mod LANES.

docs/fpga.md ("Kernel structure") gives the II and bandwidth these aim at.
"""
from __future__ import annotations

import ast
import operator
import re
import shutil
import subprocess

import pytest

from l2l.eps import hls_csim_backend as hcb

SOURCE = hcb.kernel_source()


@pytest.fixture(scope="module")
def cxx():
    path = shutil.which(hcb.DEFAULT_CXX)
    if path is None:
        pytest.fail(f"no {hcb.DEFAULT_CXX} on PATH: the m_axi check expands the macros with the C preprocessor "
                    "(the HLS C-simulation needs it too; Debian: apt-get install g++)", pytrace=False)
    return path


# --------------------------------------------------------------------------
# source helpers
# --------------------------------------------------------------------------


def _strip_comments(src: str) -> str:
    """The source without // and /* */ comments (it has no string literal holding either)."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _match(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at ``start``."""
    assert text[start] == open_, text[start:start + 40]
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise AssertionError(f"unbalanced {open_!r} at {start}")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv}


def _constants(src: str) -> dict[str, int]:
    """The ``constexpr unsigned NAME = <integer expression>;`` constants, evaluated in order."""
    values: dict[str, int] = {}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(ast.dump(node))

    for name, expr in re.findall(r"constexpr unsigned (\w+) = ([^;]+);", src):
        values[name] = ev(ast.parse(expr.strip(), mode="eval").body)
    return values


def _value(token: str, consts: dict[str, int]) -> int | None:
    if token.isdigit():
        return int(token)
    return consts.get(token)


def _functions(src: str) -> dict[str, str]:
    """name -> body of every ``void`` function of the (comment-free) source outside the macros."""
    out = {}
    for found in re.finditer(r"(?m)^(?:template <[^>]*>\s*)?(?:inline\s+)?void\s+(\w+)\s*\(", src):
        close = _match(src, found.end() - 1, "(", ")")
        brace = src.index("{", close)
        if src[close:brace].strip():  # a declaration, or something that is not a plain definition
            continue
        out[found.group(1)] = src[brace:_match(src, brace, "{", "}")]
    return out


def _calls(body: str, known) -> list[tuple[str, str]]:
    """(name, argument text) of the calls in ``body`` to functions in ``known``, in order."""
    out = []
    for found in re.finditer(r"\b(\w+)\s*(?:<[^;(){}]*>)?\s*\(", body):
        if found.group(1) in known:
            close = _match(body, found.end() - 1, "(", ")")
            out.append((found.group(1), body[found.end():close - 1]))
    return out


# --------------------------------------------------------------------------
# the three checks: each returns the problems it finds (empty: all well)
# --------------------------------------------------------------------------


def maxi_problems(src: str, cxx: str, tmp_path) -> list[str]:
    """Interface pragmas of every top function, after the preprocessor."""
    path = tmp_path / "eps_kernels.cpp"
    path.write_text(src)
    child = subprocess.run([cxx, "-std=c++17", "-E", "-P", str(path)], capture_output=True, text=True,
                           check=False)
    assert child.returncode == 0, child.stderr
    tops = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r'extern "C" void (eps_\w+)\((.*?)\)\s*\{(.*?)(?=extern "C"|\Z)', child.stdout, re.S)}
    problems = [f"{name}: top function missing" for name in hcb.KERNEL_NAMES if name not in tops]
    for name, (params, body) in tops.items():
        pointers, scalars = [], []
        for p in params.split(","):
            (pointers if "*" in p else scalars).append(re.findall(r"\w+", p)[-1])
        pragmas = re.findall(r"#pragma HLS INTERFACE (\w+) (.*)", body)
        maxi = {}
        for mode, text in pragmas:
            opts = dict(re.findall(r"(\w+)=(\S+)", text))
            if mode != "m_axi":
                continue
            port = opts.get("port")
            if port is None:
                problems.append(f"{name}: m_axi pragma without port=: {text}")
                continue
            maxi[port] = opts
            where = f"{name}.{port}"
            if opts.get("offset") != "slave":
                problems.append(f"{where}: no offset=slave")
            for key in ("max_read_burst_length", "max_write_burst_length"):
                v = opts.get(key, "")
                if not (v.isdigit() and 2 <= int(v) <= 256):
                    problems.append(f"{where}: {key} {v or 'missing'} (want 2 .. 256 beats)")
            for key in ("num_read_outstanding", "num_write_outstanding"):
                v = opts.get(key, "")
                if not (v.isdigit() and int(v) >= 1):
                    problems.append(f"{where}: {key} {v or 'missing'}")
            v = opts.get("depth", "")
            if not (v.isdigit() and int(v) >= 1):
                problems.append(f"{where}: depth {v or 'missing'} (want a number of elements)")
        if sorted(maxi) != sorted(pointers):
            problems.append(f"{name}: m_axi ports {sorted(maxi)}, pointer arguments {sorted(pointers)}")
        bundles = [opts.get("bundle") for opts in maxi.values()]
        if None in bundles or len(set(bundles)) != len(bundles):
            problems.append(f"{name}: bundles {bundles}: want one of its own per port")
        lite = sorted(dict(re.findall(r"(\w+)=(\S+)", text)).get("port", "?")
                      for mode, text in pragmas if mode == "s_axilite")
        if lite != sorted(scalars + ["return"]):
            problems.append(f"{name}: s_axilite ports {lite}, scalars {sorted(scalars)} and return")
    return problems


_READ, _WRITE = ("read_",), ("write_",)
MACROS = ("EPS_CHECK", "EPS_UPDATE", "EPS_LION", "EPS_LAMB_NORMS", "EPS_LAMB_STEP",
          "EPS_COPY")  # the top functions' macros, one per family


def dataflow_problems(src: str) -> list[str]:
    """Every kernel reaches a canonical dataflow region of read, compute and write processes."""
    src = _strip_comments(src)
    funcs = _functions(src)
    regions = {name for name, body in funcs.items() if re.search(r"#pragma HLS DATAFLOW\b", body, re.I)}
    problems = []
    for macro in MACROS:
        body = re.search(rf"#define {macro}\(.*?\n\n", src, re.S)
        if body is None:
            problems.append(f"{macro}: macro not found")
            continue
        entry = re.findall(r"eps::(\w+)\s*<", body.group(0))
        seen, todo = set(), list(entry)
        while todo:
            f = todo.pop()
            if f in seen or f not in funcs:
                continue
            seen.add(f)
            todo.extend(name for name, _ in _calls(funcs[f][1:], funcs))
        if not entry or not seen & regions:
            problems.append(f"{macro}: kernel {entry} reaches no function with #pragma HLS DATAFLOW")
    for region in sorted(regions):
        body = funcs[region][1:-1]
        fifos = re.findall(r"^\s*fifo<.*>\s+(\w+);\s*$", body, re.M)
        depths = set(re.findall(r"#pragma HLS STREAM variable=(\w+) depth=\w+", body))
        calls = _calls(body, funcs)
        rest = re.sub(r"(?m)^\s*#pragma[^\n]*$", "", body)
        rest = re.sub(r"(?m)^\s*fifo<.*>\s+\w+;\s*$", "", rest)
        for name in {name for name, _ in calls}:
            rest = re.sub(rf"\b{name}\s*(?:<[^;(){{}}]*>)?\s*\([^;]*\)\s*;", "", rest)
        if rest.strip():
            problems.append(f"{region}: not canonical (only FIFO declarations, pragmas and calls): "
                            f"{' '.join(rest.split())[:80]!r}")
        for fifo in fifos:
            if fifo not in depths:
                problems.append(f"{region}: FIFO {fifo} has no #pragma HLS STREAM depth")
            users = [name for name, args in calls if re.search(rf"\b{fifo}\b", args)]
            if len(users) != 2:
                problems.append(f"{region}: FIFO {fifo} used by {users}: want one writer and one reader")
        names = [name for name, _ in calls]
        kinds = {"read": [n for n in names if n.startswith(_READ)], "write": [n for n in names if n.startswith(_WRITE)],
                 "compute": [n for n in names if not n.startswith(_READ + _WRITE)]}
        for kind, members in kinds.items():
            if not members:
                problems.append(f"{region}: no {kind} process")
    if not regions:
        problems.append("no dataflow region at all")
    return problems


def loop_problems(src: str) -> list[str]:
    """Every loop: a label and a trip count; innermost loops II=1 (or unrolled); outer loops not pipelined.

    A loop that calls a region or process (the block loops) counts as an outer loop."""
    consts = _constants(src)
    src = _strip_comments(src)
    funcs = _functions(src)
    problems = []
    for found in re.finditer(r"\b(for|while)\s*\(", src):
        line = src.count("\n", 0, found.start()) + 1
        where = f"line {line} ({found.group(1)})"
        label = re.search(r"(\w+):\s*$", src[:found.start()])
        if label is None:
            problems.append(f"{where}: no label")
        else:
            where = f"loop {label.group(1)} at line {line}"
        after = _match(src, found.end() - 1, "(", ")")
        brace = re.match(r"\s*\{", src[after:])
        if brace is None:
            problems.append(f"{where}: body not in braces")
            continue
        start = after + brace.end() - 1
        body = src[start:_match(src, start, "{", "}")]
        nested = re.search(r"\b(for|while)\s*\(", body)
        own = body[:nested.start()] if nested else body
        trip = re.search(r"#pragma HLS loop_tripcount min=(\w+) max=(\w+) avg=(\w+)", own, re.I)
        if trip is None:
            problems.append(f"{where}: no #pragma HLS loop_tripcount min= max= avg=")
        else:
            lo, hi, avg = (_value(t, consts) for t in trip.groups())
            if None in (lo, hi, avg) or not 0 <= lo <= avg <= hi:
                problems.append(f"{where}: trip count {trip.groups()} -> {(lo, hi, avg)}: want 0 <= min <= avg <= max")
        pipelined = re.search(r"#pragma HLS PIPELINE II=1\b", own)
        unrolled = re.search(r"#pragma HLS UNROLL\b", own, re.I)
        if nested is None and _calls(body, funcs):  # runs a region or process per iteration: an outer loop
            nested = True
        if nested is None and not (pipelined or unrolled):
            problems.append(f"{where}: innermost loop neither #pragma HLS PIPELINE II=1 nor UNROLL")
        if nested and re.search(r"#pragma HLS PIPELINE", own, re.I):
            problems.append(f"{where}: an outer loop pipelined (it would unroll the loops inside)")
    return problems


def lane_sum_problems(src: str) -> list[str]:
    """lane_sums: LANES accumulators per sum, completely partitioned, indexed by i % LANES in
    its pipelined accumulate loop, with a true RAW dependence at distance LANES declared."""
    consts = _constants(src)
    funcs = _functions(_strip_comments(src))
    body = funcs.get("lane_sums")
    if body is None:
        return ["lane_sums: function not found"]
    problems = []
    lanes = consts.get("LANES")
    if lanes != 16:
        problems.append(f"LANES is {lanes}: the contract's lanes are 16 (numerics.LANES)")
    loop = re.search(r"accumulate:\s*for\s*\(.*?\)\s*\{(.*?)\n    \}", body, re.S)
    if loop is None:
        return problems + ["lane_sums: no loop labelled accumulate"]
    for acc in ("acc_p", "acc_u"):
        if not re.search(rf"float {acc}\[LANES\];", body):
            problems.append(f"lane_sums: {acc} is not float[LANES]")
        if not re.search(rf"#pragma HLS ARRAY_PARTITION variable={acc} complete\b", body):
            problems.append(f"lane_sums: {acc} not completely partitioned")
        dep = re.search(rf"#pragma HLS DEPENDENCE variable={acc} inter RAW distance=(\w+) true\b", loop.group(1))
        if dep is None or _value(dep.group(1), consts) != lanes:
            problems.append(f"lane_sums: accumulate declares no true RAW dependence on {acc} at distance LANES")
        if not re.search(rf"{acc}\[j\] = ", loop.group(1)):
            problems.append(f"lane_sums: accumulate does not write {acc}[j]")
    if not re.search(r"const unsigned j = i % LANES;", loop.group(1)):
        problems.append("lane_sums: the lane is not the element's position mod LANES")
    return problems


# --------------------------------------------------------------------------
# the source as it is
# --------------------------------------------------------------------------


def test_every_m_axi_port_has_bursts_and_depth(cxx, tmp_path):
    assert maxi_problems(SOURCE, cxx, tmp_path) == []


def test_every_kernel_runs_a_dataflow_region():
    assert dataflow_problems(SOURCE) == []


def test_every_loop_has_a_trip_count_and_ii():
    assert loop_problems(SOURCE) == []
    # and the checks did see the loops and regions there are
    assert len(re.findall(r"#pragma HLS loop_tripcount", SOURCE)) >= 12
    assert len(re.findall(r"#pragma HLS DATAFLOW", SOURCE)) == len(MACROS)  # one region per kernel family


def test_lane_sums_declare_their_dependence():
    assert lane_sum_problems(SOURCE) == []


def test_the_m_axi_depths_cover_the_cosim_bench():
    """depth= is in elements; the co-simulation bench the comment names (one block and part of
    the next, k <= 4) fits, and the gradient ports hold k times the others."""
    consts = _constants(SOURCE)
    depth = {k: int(v) for k, v in re.findall(r"#define EPS_DEPTH_(\w+) (\d+)", SOURCE)}
    assert set(depth) == {"g", "gr", "p", "m", "v", "copy", "finite", "seg", "sums", "steps"}
    assert depth["p"] == depth["m"] == depth["v"] == depth["copy"] > consts["BLOCK"]
    assert depth["g"] == depth["gr"] == 4 * depth["p"] and depth["finite"] == 1
    # LAMB's: nseg + 1 bounds, SUMS floats and one step size per segment, for one bench of nseg segments
    nseg = depth["steps"]
    assert nseg >= 8 and depth["seg"] == nseg + 1 and depth["sums"] == nseg * consts["SUMS"]
    assert consts["SUMS"] == 2 * consts["LANES"] == 32


# --------------------------------------------------------------------------
# each check fails when one directive is removed
# --------------------------------------------------------------------------


def _without(line_pattern: str, nth: int = 0) -> str:
    """SOURCE with the nth line matching ``line_pattern`` removed."""
    lines = SOURCE.split("\n")
    hits = [i for i, line in enumerate(lines) if re.search(line_pattern, line)]
    assert len(hits) > nth, (line_pattern, nth, len(hits))
    del lines[hits[nth]]
    return "\n".join(lines)


@pytest.mark.parametrize("edit", ["max_read_burst_length", "max_write_burst_length", "depth",
                                  "num_read_outstanding", "define_depth_copy", "shared_bundle",
                                  "lion_shared_bundle", "lamb_shared_bundle", "lamb_no_seg_port",
                                  "plain_port"])
def test_m_axi_check_catches_a_missing_option(cxx, tmp_path, edit):
    if edit == "define_depth_copy":
        src = _without(r"^#define EPS_DEPTH_copy ")
    elif edit == "shared_bundle":
        src = SOURCE.replace("EPS_MAXI(m, gmem2)", "EPS_MAXI(m, gmem1)")
    elif edit == "lion_shared_bundle":  # in eps_lion only (the first of eps_lion, eps_lamb_step): copy on m's bundle
        assert SOURCE.count("EPS_MAXI(copy, gmem3)") == 2
        assert SOURCE.index("EPS_MAXI(copy, gmem3)") < SOURCE.index("#define EPS_LAMB_STEP")
        src = SOURCE.replace("EPS_MAXI(copy, gmem3)", "EPS_MAXI(copy, gmem2)", 1)
    elif edit == "lamb_shared_bundle":  # in eps_lamb_norms only: its sums on its seg's bundle
        assert SOURCE.count("EPS_MAXI(sums, gmem5)") == 1
        src = SOURCE.replace("EPS_MAXI(sums, gmem5)", "EPS_MAXI(sums, gmem4)")
    elif edit == "lamb_no_seg_port":  # eps_lamb_step's seg without its interface pragma
        assert SOURCE.count("EPS_MAXI(seg, gmem4)") == 2
        src = _without(r"EPS_MAXI\(seg, gmem4\)", 1)
    elif edit == "plain_port":  # the old spelling: the parameter replaces the keyword too (g=g)
        src = SOURCE.replace("EPS_KW_port=port offset", "port=port offset")
    else:  # the option taken out of the EPS_MAXI macro
        macro = re.search(r"#define EPS_MAXI\(.*?\n\n", SOURCE, re.S).group(0)
        edited, count = re.subn(rf"{edit}=[^\s)]+ ?", "", macro, count=1)
        assert count == 1
        src = SOURCE.replace(macro, edited)
    assert src != SOURCE
    problems = maxi_problems(src, cxx, tmp_path)
    assert problems, edit
    if edit == "define_depth_copy":
        assert all(".copy: depth" in p for p in problems), problems


def test_dataflow_check_catches_a_missing_region_or_stream():
    for nth in range(len(MACROS)):
        problems = dataflow_problems(_without(r"#pragma HLS DATAFLOW", nth))
        assert any("reaches no function with #pragma HLS DATAFLOW" in p for p in problems), (nth, problems)
    problems = dataflow_problems(_without(r"#pragma HLS STREAM variable=m_in "))
    assert problems == ["update_block: FIFO m_in has no #pragma HLS STREAM depth"], problems
    problems = dataflow_problems(_without(r"#pragma HLS STREAM variable=m_in ", 1))
    assert problems == ["lion_block: FIFO m_in has no #pragma HLS STREAM depth"], problems
    # LAMB's regions: the norm pass's lane-sum FIFO, the step pass's v_in
    problems = dataflow_problems(_without(r"#pragma HLS STREAM variable=lanes "))
    assert problems == ["lamb_norms_block: FIFO lanes has no #pragma HLS STREAM depth"], problems
    problems = dataflow_problems(_without(r"#pragma HLS STREAM variable=v_in ", 2))
    assert problems == ["lamb_step_block: FIFO v_in has no #pragma HLS STREAM depth"], problems
    # the sums written by nothing: lane_sums' output FIFO without its writer process
    src = SOURCE.replace("    write_sums(lanes, sums, sbase);\n", "")
    assert src != SOURCE
    assert any("FIFO lanes used by ['lane_sums']" in p for p in dataflow_problems(src))
    # a FIFO with a second reader, and a statement that is not a process call
    src = SOURCE.replace("    write_array<float>(v_out, v, base, len);\n",
                         "    write_array<float>(v_out, v, base, len);\n    write_array<float>(m_in, v, base, len);\n")
    assert any("FIFO m_in used by" in p for p in dataflow_problems(src))
    src = SOURCE.replace("    reduce<G>(raw, sums, k, len);\n    all_finite", "    reduce<G>(raw, sums, k, len);\n"
                         "    if (k == 0) return;\n    all_finite")
    assert any("check_block: not canonical" in p for p in dataflow_problems(src))


def test_loop_check_catches_a_missing_trip_count_or_pipeline():
    trips = len(re.findall(r"#pragma HLS loop_tripcount", SOURCE))
    for nth in range(trips):  # every single trip count, removed in turn
        problems = loop_problems(_without(r"#pragma HLS loop_tripcount", nth))
        assert len(problems) == 1 and "no #pragma HLS loop_tripcount" in problems[0], (nth, problems)
    pipes = len(re.findall(r"#pragma HLS PIPELINE II=1", SOURCE))
    for nth in range(pipes):
        problems = loop_problems(_without(r"#pragma HLS PIPELINE II=1", nth))
        assert len(problems) == 1 and "neither" in problems[0], (nth, problems)
    bad = SOURCE.replace("min=1 max=TILE avg=TILE", "min=1 max=TILE avg=NO_SUCH_CONSTANT", 1)
    assert any("trip count" in p for p in loop_problems(bad))
    bad = SOURCE.replace("min=1 max=MAX_K avg=AVG_K", "min=1 max=MAX_K avg=BLOCK", 1)
    assert any("want 0 <= min <= avg <= max" in p for p in loop_problems(bad))
    bad = SOURCE.replace("#pragma HLS loop_tripcount min=1 max=TILES avg=TILES",
                         "#pragma HLS PIPELINE II=1\n#pragma HLS loop_tripcount min=1 max=TILES avg=TILES", 1)
    assert any("outer loop pipelined" in p for p in loop_problems(bad))


@pytest.mark.parametrize("edit", ["dependence", "distance", "partition", "lanes", "index"])
def test_lane_sum_check_catches_a_missing_directive(edit):
    if edit == "dependence":
        bad = _without(r"#pragma HLS DEPENDENCE variable=acc_u ")
    elif edit == "distance":
        bad = SOURCE.replace("variable=acc_p inter RAW distance=16 true", "variable=acc_p inter RAW distance=1 true")
    elif edit == "partition":
        bad = _without(r"#pragma HLS ARRAY_PARTITION variable=acc_p ")
    elif edit == "lanes":
        bad = SOURCE.replace("constexpr unsigned LANES = 16;", "constexpr unsigned LANES = 8;")
    else:
        bad = SOURCE.replace("const unsigned j = i % LANES;", "const unsigned j = (i + 1) % LANES;")
    assert bad != SOURCE
    assert lane_sum_problems(bad), edit
