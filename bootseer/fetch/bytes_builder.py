"""A ``bytes`` object filled in place: what a read returns without holding its bytes twice.

``read`` and ``Client.read_bytes`` must return ``bytes`` (safetensors takes nothing
else), and filling a bytearray then copying it into bytes would hold a whole file
twice.  CPython's documented way to build a bytes object in place is
PyBytes_FromStringAndSize(NULL, n) followed by writing its buffer before anyone else
sees the object; elsewhere we fall back to the copy.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

if platform.python_implementation() == "CPython":
    _bytes_from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _bytes_from_size.restype = ctypes.py_object
    _bytes_from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _bytes_buffer = ctypes.pythonapi.PyBytes_AsString
    _bytes_buffer.restype = ctypes.c_void_p
    _bytes_buffer.argtypes = (ctypes.py_object,)
else:  # pragma: no cover
    _bytes_from_size = None


class BytesBuilder:
    """A ``bytes`` object of a known size, written through :attr:`view` before use.

    Keep the builder until the view is fully written, then take :meth:`result`;
    nothing may use the bytes before that.
    """

    def __init__(self, size: int) -> None:
        if size == 0:
            self._bytes: bytes | None = b""
            self._buffer: Any = bytearray()
        elif _bytes_from_size is not None:
            self._bytes = _bytes_from_size(None, size)
            self._buffer = (ctypes.c_char * size).from_address(_bytes_buffer(self._bytes))
        else:  # pragma: no cover
            self._bytes = None
            self._buffer = bytearray(size)
        self.view = memoryview(self._buffer).cast("B")

    def result(self) -> bytes:
        self.view.release()
        return self._bytes if self._bytes is not None else bytes(self._buffer)
