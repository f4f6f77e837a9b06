#!/usr/bin/env bash
# A libnccl with ncclCommSuspend (NCCL >= 2.29.7) for the device machine, which has only torch's 2.28.9 and
# no network: a device call carries at most 64 MiB, the library is 299 MB (230 MB compressed), so it
# travels in pieces over back-to-back calls (a warm machine keeps ignored files between calls).
#
#   bash scripts/nccl_pieces.sh split            # here: PyPI's nvidia-nccl-cu13 wheel -> .nccl_parts/NN (xz, 40 MB each)
#   bash scripts/nccl_pieces.sh join DIR         # there: .nccl_parts/* -> DIR/libnccl.so.2, checked against its sha256
#
# Then SLEEPSERVE_NCCL_SO=DIR/libnccl.so.2 (make gpu-check ARGS=nccl-suspend does the join and the export).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${NCCL_VERSION:-2.31.2}
PARTS=.nccl_parts
case ${1:-} in
  split)
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-nccl-cu13==$VERSION" -d "$work"
    python3 - "$work" "$PARTS" <<'PY'
import glob, hashlib, lzma, os, sys, zipfile
sys.path.insert(0, "scripts")
import pieces
work, parts = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "nvidia_nccl_cu13-*.whl"))[0]
data = zipfile.ZipFile(wheel).read("nvidia/nccl/lib/libnccl.so.2")
packed = lzma.compress(data, preset=6)
count = pieces.split(packed, parts, 40 * 10**6, hashlib.sha256(data).hexdigest())
print(f"{os.path.basename(wheel)}: libnccl.so.2 {len(data)} bytes, {len(packed)} compressed in "
      f"{count} pieces under {parts}/ (carry sha256 and 00 in the first call, one more per call)")
PY
    rm -rf "$work" ;;
  join)
    out=${2:?join needs the folder to write libnccl.so.2 in}
    mkdir -p "$out"
    python3 - "$PARTS" "$out" <<'PY'
import hashlib, lzma, os, sys
sys.path.insert(0, "scripts")
import pieces
parts, out = sys.argv[1], sys.argv[2]
packed, (want, *_), count = pieces.join(parts)
try:
    data = lzma.decompress(packed)
except lzma.LZMAError as e:
    sys.exit(f"the {count} pieces under {parts}/ do not make the library ({e}): one is missing?")
if hashlib.sha256(data).hexdigest() != want:
    sys.exit(f"the joined library's sha256 is not the one recorded in {parts}/sha256")
with open(os.path.join(out, "libnccl.so.2"), "wb") as f:
    f.write(data)
print(f"{out}/libnccl.so.2: {len(data)} bytes from {count} pieces, sha256 checked")
PY
    ;;
  *) echo "usage: $0 split | join DIR" >&2; exit 2 ;;
esac
