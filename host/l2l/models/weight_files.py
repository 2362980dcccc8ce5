"""A model directory's safetensors weights: every file checked up front, tensors read lazily.

The index is not trusted. Before anything is read or written, every shard that
``model.safetensors.index.json`` names must exist and have a header that parses and
whose byte ranges fit the file (:func:`l2l.checkpoint.safetensors_header`: a truncated
shard is found by its size, a corrupt one by its header), every tensor the index lists
must be in the shard it names, and (:meth:`SafetensorsWeights.check`) every tensor the
model needs must be there with the config's shape and a floating-point dtype that
converts to fp32. Only headers are read: a check costs a few reads per shard, whatever
the model's size; the weights are read when the EPS asks for them, one tensor at a time.

The tensor index (every tensor's name, dtype and shape, not its bytes) is also what
identifies a checkpoint's weights (:meth:`SafetensorsWeights.digest`): reading every
weight to hash it would cost as much as training on it once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import safetensors_header
from ..errors import UserError, one_line

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")
READABLE = ("F32", "F16", "BF16", "F64")  # the dtypes a weight may have: floating point, converted to fp32


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str  # the safetensors code (F32, BF16, ...)
    shape: tuple[int, ...]


class SafetensorsWeights:
    """The tensors of a model directory's safetensors files, by name; the files are checked
    when this is made (one line, :class:`UserError`, for anything wrong)."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        self.tensors = _stored_tensors(self.root)

    def digest(self) -> str:
        """SHA-256 of the tensor index: each tensor's name, dtype and shape, sorted by name
        (not the shard files' names: the same tensors sharded otherwise are the same weights)."""
        index = [[name, t.dtype, list(t.shape)] for name, t in sorted(self.tensors.items())]
        return hashlib.sha256(json.dumps(index, separators=(",", ":")).encode()).hexdigest()

    def check(self, needed: list[tuple[str, tuple[int, ...]]], base_prefix: str = "") -> list[str]:
        """The stored name of each needed ``(name, shape)``, in order, after checking that each
        is there with that shape and a :data:`READABLE` dtype. ``base_prefix``: the base
        model's attribute (``transformer``, ``bert``), which a checkpoint saved from the base
        model alone leaves out of its names."""
        prefix = base_prefix + "." if base_prefix else ""
        stored, missing = [], []
        for name, shape in needed:
            key = name
            if key not in self.tensors and prefix and name.startswith(prefix):
                key = name[len(prefix):]
            t = self.tensors.get(key)
            if t is None:
                missing.append(name)
                continue
            if t.shape != tuple(shape):
                raise UserError(f"{t.file}: tensor {key!r} has shape {t.shape}, the config says {tuple(shape)}")
            if t.dtype not in READABLE:
                raise UserError(f"{t.file}: tensor {key!r} is {t.dtype}; weights must be one of "
                                f"{', '.join(READABLE)}")
            stored.append(key)
        if missing:
            more = f" (and {len(missing) - 1} more the model needs)" if len(missing) > 1 else ""
            raise UserError(f"{self.root}: the checkpoint has no tensor {missing[0]!r}{more}")
        return stored

    def read(self, stored: str) -> torch.Tensor:
        """A tensor by its stored name (one :meth:`check` returned), in its stored dtype."""
        from safetensors import safe_open
        with safe_open(str(self.tensors[stored].file), framework="pt") as f:
            return f.get_tensor(stored)


def _stored_tensors(root: Path) -> dict[str, StoredTensor]:
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise ValueError("weight_map is not a map of tensor names to files")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{root / INDEX}: not a readable safetensors index ({one_line(exc)})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(f"{root}: shard {missing[0]}{more}, named in {INDEX}, is missing")
        headers = {s: stored_tensors_of(root / s) for s in shards}
        tensors = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise UserError(f"{root / shard}: holds no tensor {name!r}, which {INDEX} puts there")
            tensors[name] = headers[shard][name]
        return tensors
    if (root / SINGLE).is_file():
        return stored_tensors_of(root / SINGLE)
    pickles = sorted(p.name for pattern in PICKLES for p in root.glob(pattern))
    if pickles:
        raise UserError(f"{root}: weights only as pickle ({', '.join(pickles)}), which l2l never loads; "
                        "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))")
    raise UserError(f"{root}: no {SINGLE} or {INDEX}")


def stored_tensors_of(path: Path) -> dict[str, StoredTensor]:
    try:
        header = safetensors_header(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({one_line(exc)})") from None
    return {name: StoredTensor(path, code, shape) for name, (_, shape, code) in header.items()}

