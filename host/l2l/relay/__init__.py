"""The relay: L2L's layer-by-layer schedule on the device (``engine.py``), K workers on one
EPS (``parallel.py``), and what they move, stash, recompute and count."""
import sys
import types


class _RelayPackage(types.ModuleType):
    """``l2l.relay`` names both this package and the public ``l2l.relay(stack, ...)``
    (:func:`l2l.build.relay`). Python makes a package, once imported, the attribute of its
    parent (``l2l.RelayEngine`` imports it), which would hide the function; so the package
    is callable as that function, whichever of the two a program touched first."""

    def __call__(self, *args, **kwargs):
        from ..build import relay
        return relay(*args, **kwargs)


sys.modules[__name__].__class__ = _RelayPackage
