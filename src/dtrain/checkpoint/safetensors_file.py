"""safetensors files of every dtype a model holds, written and read back bit for bit.

safetensors stores each torch dtype natively (complex64 as C64, bf16, bool, every integer
width) except complex128 and complex32. A tensor of those two is stored as its real view
(`torch.view_as_real`: a last dimension of 2, of float64 or float16) and its name listed in
the file's metadata under REAL_VIEWS; :class:`TensorFile` gives it back as the complex
tensor it was. A reader without dtrain sees the real view under the same name.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
"""The torch dtype of each safetensors dtype name (a header's ``dtype``)."""

REAL_VIEWS = "dtrain.real_views"
"""The metadata key listing (as a JSON list) the tensors stored as their real view."""
_STORED_AS_REAL = (torch.complex128, torch.complex32)


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each one that shares memory with an earlier one copied.

    Tied weights (an output layer that is the input embedding) can arrive as one tensor
    under two names (a plain ``torch.save`` file keeps the tie, and so does a state handed
    over uncopied); safetensors refuses shared memory, and a plain `load_state_dict` of
    the file wants every name, so each name gets its own copy.
    """
    seen: set[tuple[torch.device, int]] = set()
    out = {}
    for name, tensor in tensors.items():
        memory = (tensor.device, tensor.untyped_storage().data_ptr())
        out[name] = tensor.clone() if memory in seen else tensor
        seen.add(memory)
    return out


def save(
    tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (on the CPU) to the safetensors `file` with `metadata`."""
    viewed = sorted(name for name, t in tensors.items() if t.dtype in _STORED_AS_REAL)
    stored = {
        name: torch.view_as_real(t) if name in viewed else t
        for name, t in unshared(tensors).items()
    }
    metadata = {**(metadata or {}), **({REAL_VIEWS: json.dumps(viewed)} if viewed else {})}
    safetensors.torch.save_file(stored, Path(file), metadata=metadata or None)


class TensorFile:
    """A safetensors file opened for reading: every name's shape from its header, and
    any tensor by name, read from disk when asked for, as :func:`save` was given it."""

    def __init__(self, file: Path) -> None:
        self._file = safe_open(str(file), framework="pt")
        self._viewed = set(json.loads((self._file.metadata() or {}).get(REAL_VIEWS, "[]")))
        self.names: list[str] = list(self._file.keys())
        self.shapes = {name: self._shape(name) for name in self.names}

    def dtype(self, name: str) -> torch.dtype | None:
        """The dtype `name` is stored in, from the header (None for a name torch lacks)."""
        return _DTYPES.get(self._file.get_slice(name).get_dtype())

    def _shape(self, name: str) -> torch.Size:
        shape = torch.Size(self._file.get_slice(name).get_shape())
        return shape[:-1] if name in self._viewed else shape

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under `name`."""
        tensor = self._file.get_tensor(name)
        return torch.view_as_complex(tensor) if name in self._viewed else tensor


def load(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors `file`, as :func:`save` was given them."""
    opened = TensorFile(file)
    return {name: opened.get(name) for name in opened.names}
