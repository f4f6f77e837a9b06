"""Read a safetensors checkpoint into host memory with plain system calls, for /update_weights.

The route runs this on a worker thread, never the engine thread: a file that blocks (a FIFO, a hung
network mount) used to freeze every route, /health included, for as long as it blocked (17 s and
55 s measured), because safetensors opened and mapped it on the engine thread while holding the
GIL. Here each file is opened non-blocking and must be a regular file, and every read is an
os.pread that releases the GIL, so a slow disk delays only this one request. The engine thread
then only checks names and shapes and copies from memory. Peak extra memory: the checkpoint's size.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch

from server.model.loader import WeightLoadError, _skip, safetensors_files

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _read_all(path: Path) -> bytearray:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise WeightLoadError(f"cannot open {path}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WeightLoadError(f"{path} is not a regular file; point path at a folder of .safetensors files")
        buf = bytearray(info.st_size)
        view = memoryview(buf)
        done = 0
        while done < info.st_size:
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise WeightLoadError(f"{path} shrank while it was read; write checkpoints before loading them")
            done += n
        return buf
    except OSError as e:
        raise WeightLoadError(f"reading {path} failed: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _parse(path: Path, buf: bytearray) -> dict[str, torch.Tensor]:
    """Views into buf for every tensor of one safetensors file, after checking its header."""
    def bad(why: str) -> WeightLoadError:
        return WeightLoadError(f"{path} is not a valid safetensors file: {why}")

    if len(buf) < 8:
        raise bad("shorter than its 8-byte header length")
    size = int.from_bytes(buf[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise bad(f"header length {size} does not fit the file")
    try:
        header = json.loads(bytes(buf[8:8 + size]))
    except (ValueError, RecursionError) as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data = memoryview(buf)[8 + size:]
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__" or _skip(name):
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a bad dtype, shape or data_offsets") from None
        count = 1
        for d in shape:
            if d < 0:
                raise bad(f"tensor {name!r} has a negative dimension")
            count *= d
        if not 0 <= start <= end <= len(data) or end - start != count * dtype.itemsize:
            raise bad(f"tensor {name!r}: data_offsets [{start}, {end}] do not match its shape and the file")
        tensor = torch.frombuffer(data[start:end], dtype=dtype) if count else torch.empty(0, dtype=dtype)
        out[name] = tensor.view(shape)
    return out


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path` (a folder or one file), in host memory."""
    named: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        named.update(_parse(f, _read_all(f)))
    return named
