"""``l2l`` with a stand-in OpenCL platform list: ``python tests/opencl_standin_l2l.py LIST l2l-args...``.

LIST ``gpu-first``: a GPU box with its vendor's OpenCL driver lists the training GPU before PoCL's CPU device.
This machine has no GPU, so a stand-in platform is listed first: its one device reports
itself a GPU named ``Stand-in GPU``, and underneath it is a one-compute-unit sub-device of the
first real CPU device, so a run that names it really runs the EPS there (on device buffers and
the GPU's launch shape, as on a GPU). Patched in from outside the package, through pyopencl
itself: ``get_platforms`` and the ``Device`` ``name`` and ``type`` properties. Which device a
run took is in its first lines and in summary.json (``eps.runs_on``).

LIST ``none``: no OpenCL platform at all (a host without one; here the opencl extra's PoCL is
found by pyopencl's own ICD loader whatever ``OCL_ICD_VENDORS`` says, so it is hidden here).
"""
from __future__ import annotations

import sys

import pyopencl as cl

STANDIN_NAME = "Stand-in GPU"
_real_get_platforms = cl.get_platforms
_real_name, _real_type = cl.Device.name, cl.Device.type
_standin: list = []  # the sub-device, made on first listing


class _StandInPlatform:
    name = vendor = "Stand-in GPU platform"
    version = "OpenCL 3.0 stand-in"

    def get_devices(self, device_type=cl.device_type.ALL):
        return list(_standin)


def _get_platforms():
    real = _real_get_platforms()
    if not _standin:
        cpu = next(d for p in real for d in p.get_devices() if _real_type.fget(d) & cl.device_type.CPU)
        _standin.append(cpu.create_sub_devices([cl.device_partition_property.EQUALLY, 1])[0])
    return [_StandInPlatform(), *real]


def _is_standin(dev) -> bool:
    return bool(_standin) and dev.int_ptr == _standin[0].int_ptr


def _gpu_first() -> None:
    cl.get_platforms = _get_platforms
    cl.Device.name = property(lambda d: STANDIN_NAME if _is_standin(d) else _real_name.fget(d))
    cl.Device.type = property(lambda d: cl.device_type.GPU if _is_standin(d) else _real_type.fget(d))


def _none() -> None:
    cl.get_platforms = lambda: []


if __name__ == "__main__":
    listing, *argv = sys.argv[1:]
    {"gpu-first": _gpu_first, "none": _none}[listing]()
    from l2l.cli import main
    sys.exit(main(argv))
