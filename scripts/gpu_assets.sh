#!/usr/bin/env bash
# Prepares what a GPU run carries (both folders are git-ignored): the wheels the device image lacks
# (.whl, via shared/tools/device-wheels.sh) and a small tokenizer for dummy-weight models (.gpu_assets).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_assets/tokenizer
src=$(.venv/bin/python -c 'from server.model.loader import resolve_model; print(resolve_model(None).folder)')
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$src/$f" ] && cp "$src/$f" .gpu_assets/tokenizer/
done
# llguidance: structured outputs (abi3 wheel, no dependencies); the image lacks it.
if [ -x ../shared/tools/device-wheels.sh ]; then bash ../shared/tools/device-wheels.sh llguidance > /dev/null; fi
du -sh .gpu_assets .whl 2>/dev/null || true
