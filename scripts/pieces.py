"""A file carried to the device machine in pieces: a call carries at most 64 MiB, and a warm machine keeps ignored
files between back-to-back calls (it gives itself back after ~30 s idle), so a larger file travels a piece a call.
scripts/nccl_pieces.sh (a libnccl) and scripts/gguf_pieces.sh (the embedded model) split here and join there
through these two functions; what a piece holds (compressed or not) and what the sha256 is of is theirs."""
from __future__ import annotations

import glob
import os


def split(blob: bytes, parts: str, piece: int, sha256_line: str) -> int:
    """blob into parts/00, 01, ... of `piece` bytes (the folder emptied first), and sha256_line into parts/sha256.
    Returns how many pieces."""
    os.makedirs(parts, exist_ok=True)
    for old in glob.glob(os.path.join(parts, "*")):
        os.remove(old)
    for i in range(0, len(blob), piece):
        with open(os.path.join(parts, f"{i // piece:02d}"), "wb") as f:
            f.write(blob[i:i + piece])
    with open(os.path.join(parts, "sha256"), "w") as f:
        f.write(sha256_line + "\n")
    return (len(blob) + piece - 1) // piece


def join(parts: str) -> tuple[bytes, list[str], int]:
    """(the pieces under parts/ end to end, the words of parts/sha256, how many pieces)."""
    pieces = sorted(glob.glob(os.path.join(parts, "[0-9][0-9]")))
    blob = b"".join(open(p, "rb").read() for p in pieces)
    return blob, open(os.path.join(parts, "sha256")).read().split(), len(pieces)
