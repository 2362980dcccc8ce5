"""The sharded EPS's device copies, gathered from their owners a window ahead of the relay.

(Being built: the constant the planner's memory model shares.)
"""
from __future__ import annotations

GATHER_WINDOW = 2  # gathered entries not yet fetched by every worker, at most, per machine
