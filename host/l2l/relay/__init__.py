"""The relay: L2L's layer-by-layer schedule on the device (``engine.py``), K workers on one
EPS (``parallel.py``), and what they move, stash, recompute and count."""
