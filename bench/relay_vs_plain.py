"""Relay step time vs the plain baseline across depths and micro-batch counts.

    python bench/relay_vs_plain.py [options]      # same as: l2l bench relay [options]
"""
import sys

from l2l.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "relay", *sys.argv[1:]]))
