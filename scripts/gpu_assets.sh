#!/usr/bin/env bash
# Prepares what a GPU run carries (both folders are git-ignored): a small tokenizer for dummy-weight
# models (.gpu_assets) and the wheels the device image lacks (.whl), built by the script that
# $SLEEPSERVE_WHEELS_SCRIPT names, when set (it belongs to the machine that lends the GPU, not to this repo).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_assets/tokenizer
src=$(.venv/bin/python -c 'from server.model.source import resolve_model; print(resolve_model(None).folder)')
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$src/$f" ] && cp "$src/$f" .gpu_assets/tokenizer/
done
# llguidance: structured outputs (abi3 wheel, no dependencies); openai (+ distro, jiter, and
# httpx2, httpcore2, truststore, and anyio>=4.10, sniffio, idna>=3.18, newer than the image's: openai 3.x's
# HTTP stack; H200 runs failed on `import openai` without them):
# bench/serve.py's client; torch-memory-saver: the `tms` stage's side-by-side (bench/tms_compare.py); uvloop and
# httptools: the server's event loop and HTTP parser (uvicorn falls back to asyncio and h11 without them); py-spy:
# serve64's profiles of the server's processes (bench/serve.py --spy). The image lacks them.
if [ -n "${SLEEPSERVE_WHEELS_SCRIPT:-}" ]; then
  bash "$SLEEPSERVE_WHEELS_SCRIPT" llguidance openai distro jiter httpx2 httpcore2 truststore anyio sniffio idna torch-memory-saver==0.0.10 uvloop httptools py-spy > /dev/null
fi
du -sh .gpu_assets .whl 2>/dev/null || true
