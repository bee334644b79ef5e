"""msgpack encoding of engine messages (msgspec), with torch tensors and numpy arrays
carried as raw bytes in an Ext type (no pickle)."""
from __future__ import annotations

from typing import Any, Optional

import msgspec
import numpy as np

_EXT_TENSOR = 1
_EXT_NDARRAY = 2


def _enc_hook(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            dtype, raw = "bfloat16", t.view(torch.int16).numpy().tobytes()
        else:
            dtype, raw = str(t.dtype).removeprefix("torch."), t.numpy().tobytes()
        header = msgspec.msgpack.encode((dtype, list(t.shape)))
        return msgspec.msgpack.Ext(_EXT_TENSOR, len(header).to_bytes(4, "little") + header + raw)
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((a.dtype.str, list(a.shape)))
        return msgspec.msgpack.Ext(_EXT_NDARRAY, len(header).to_bytes(4, "little") + header + a.tobytes())
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + n])
    raw = bytes(data[4 + n:])
    if code == _EXT_TENSOR:
        import torch

        if dtype == "bfloat16":
            arr = np.frombuffer(raw, dtype=np.int16).reshape(shape)
            return torch.from_numpy(arr.copy()).view(torch.bfloat16)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy())
    if code == _EXT_NDARRAY:
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise ValueError(f"unknown msgpack ext type {code}")


class MsgpackEncoder:
    """Encodes msgspec Structs (and tensors inside them) to bytes."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._enc.encode(obj)


class MsgpackDecoder:
    """Decodes bytes into the given type (a msgspec Struct class or Any)."""

    def __init__(self, t: Optional[Any] = None) -> None:
        self._dec = msgspec.msgpack.Decoder(t if t is not None else Any, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._dec.decode(data)
