"""The CUDA transport with its ordering calls switched off one at a time (the mutation test's).

:func:`routed_transport` compiles ``l2l/relay/transport.py`` afresh with every call of
``wait_stream``, ``wait_event`` and ``record_stream`` in it routed through a
:class:`Switch`: a call *site* is one such call in the source, and the switch
turns a site off for one stream (the side stream whose copy the call orders) or
all of them, and notes which (site, stream) pairs a run reached. The module is
the real source, not a copy: a call added to the transport is a new site.
"""
from __future__ import annotations

import ast
import types
from pathlib import Path

import l2l.relay.transport as transport

from fake_cuda import FakeEvent, FakeStream

ORDERING = ("wait_stream", "wait_event", "record_stream")
STREAMS = ("copy_in", "copy_out", "stash_in", "stash_out")  # the transport's side streams


class Switch:
    """Forwards the routed calls, except the one at ``off`` = (site, stream label; ``"*"``: any)."""

    def __init__(self) -> None:
        self.off: tuple[str, str] | None = None
        self.reached: set[tuple[str, str]] = set()

    def __call__(self, site: str, method, *args, **kwargs):
        stream = _side_stream(method.__self__, *args)
        self.reached.add((site, stream))
        if self.off is not None and self.off[0] == site and self.off[1] in ("*", stream):
            return None
        return method(*args, **kwargs)


def _side_stream(*operands) -> str:
    """The label of the side stream an ordering call concerns: the one that waits or records,
    or, for the compute stream waiting on an event, the event's stream."""
    for x in operands:
        s = x.stream if isinstance(x, FakeEvent) else x
        if isinstance(s, FakeStream) and not s.present:
            return s.label
    raise AssertionError(f"no side stream among {operands}")


class _Route(ast.NodeTransformer):
    def __init__(self) -> None:
        self.sites: list[str] = []
        self._where: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef):
        self._where.append(node.name)
        self.generic_visit(node)
        self._where.pop()
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if not (isinstance(node.func, ast.Attribute) and node.func.attr in ORDERING):
            return node
        site = f"{'.'.join(self._where)}:{node.func.attr}@{node.lineno}"
        self.sites.append(site)
        routed = ast.Call(func=ast.Name("__ordering__", ast.Load()),
                          args=[ast.Constant(site), node.func, *node.args], keywords=node.keywords)
        return ast.copy_location(routed, node)


def routed_transport(switch: Switch) -> tuple[types.ModuleType, list[str]]:
    """``l2l.relay.transport`` compiled with its ordering calls routed through ``switch``, and the sites."""
    path = Path(transport.__file__)
    route = _Route()
    tree = ast.fix_missing_locations(route.visit(ast.parse(path.read_text(), str(path))))
    module = types.ModuleType("l2l.relay._routed_transport")
    module.__package__, module.__file__, module.__ordering__ = "l2l.relay", str(path), switch
    exec(compile(tree, str(path), "exec"), module.__dict__)
    return module, route.sites


def name_streams(t) -> None:
    """Label a transport's fake streams by their role (errors and ``Switch.reached`` say which)."""
    for name in STREAMS:
        getattr(t, name).label = name
