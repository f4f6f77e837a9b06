"""What a streamed token costs the API process, against the floor of streaming at all.

The server's API process writes one SSE chunk per request per engine step (fewer when a client is behind:
then steps merge). Its CPU per chunk caps streamed throughput at about 1 / (that cost) chunks per second,
whatever the engine does. This measures that cost and its reference in one run, with one client:

- server: C streamed `/v1/completions` requests of T tokens at once through the real server, CPU seconds of
  its API process (and, for scale, its engine process) per content chunk received;
- floor: a bare ASGI app under the same uvicorn (same event loop and HTTP parser) that streams T chunks of the
  same size to each of C requests, every stream woken once per "step" as the engine's frames wake them, with
  the step the server's run averaged; its CPU per chunk is what uvicorn, the event loop and the socket writes
  cost before any of our code runs.

The client is plain sockets in threads of this process (cheap, so the two servers, not the client, are what
the CPU figures describe). Printed: both costs, their ratio, and the chunks per second each allows.

    python bench/sse_floor.py                      # CPU, llama-micro: 64 streams x 256 tokens
    python bench/sse_floor.py --device cuda --model llama-1b --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402
from bench.spy import cpu_seconds  # noqa: E402

TIMEOUT_S = 600.0  # a stalled server fails the run instead of hanging it


def stream_one(port: int, body: bytes, out: list) -> None:
    """POST body, read the SSE stream to its end; append (content chunks, bytes of the first one), or the
    exception that stopped it (burst raises it)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            data = bytearray()
            while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
                got = s.recv(1 << 16)
                if not got:
                    raise RuntimeError(f"the connection closed before the stream ended: {bytes(data)[-200:]!r}")
                data += got
                if not data.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in data:
                    raise RuntimeError(f"the server refused the request: {bytes(data)[:300]!r}")
        text = bytes(data)
        start = text.find(b"data: {")
        size = text.index(b"\n\n", start) + 2 - start if start >= 0 else 0
        out.append((text.count(b"data: {") - text.count(b'"text":""'), size))  # chunks with content; one's bytes
    except Exception as e:  # noqa: BLE001 - a thread's exception would only be printed: burst raises it
        out.append(e)


def burst(port: int, body: bytes, c: int) -> tuple[int, int, float]:
    """C streams at once; (content chunks, bytes of a chunk, wall seconds)."""
    out: list = []
    threads = [threading.Thread(target=stream_one, args=(port, body, out), daemon=True) for _ in range(c)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT_S)
    wall = time.perf_counter() - t
    errors = [e for e in out if isinstance(e, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {c} streams failed: {errors[0]}") from errors[0]
    if len(out) < c:
        raise RuntimeError(f"{c - len(out)} of {c} streams did not end within {TIMEOUT_S:.0f} s")
    return sum(n for n, _ in out), max(b for _, b in out), wall


# The floor's app: written to floor_app.py and served by `uvicorn floor_app:app` in its own process; FLOOR_*
# set its stream.
FLOOR_APP = '''
import asyncio, os
CHUNKS, STEP = int(os.environ["FLOOR_CHUNKS"]), float(os.environ["FLOOR_STEP_S"])
CHUNK = b'data: {"text":"' + b"x" * (int(os.environ["FLOOR_CHUNK_BYTES"]) - 19) + b'"}\\n\\n'  # as many bytes
step = None

async def ticker():
    global step
    while True:
        await asyncio.sleep(STEP)
        done, step = step, asyncio.Event()
        done.set()

async def app(scope, receive, send):
    global step
    if scope["type"] != "http":
        return
    if step is None:
        step = asyncio.Event()
        asyncio.ensure_future(ticker())
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(CHUNKS):
        await step.wait()
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\\n\\n", "more_body": False})
'''


def measure(port: int, pid: int, body: bytes, c: int, rounds: int, extra_pid: int | None = None) -> dict:
    burst(port, body, c)  # warm: connections, first-call costs
    chunks = size = 0
    wall = 0.0
    c0 = cpu_seconds(pid)
    e0 = cpu_seconds(extra_pid) if extra_pid else 0.0
    for _ in range(rounds):
        n, size, w = burst(port, body, c)
        chunks, wall = chunks + n, wall + w
    cpu = cpu_seconds(pid) - c0
    if not chunks:
        raise RuntimeError("no stream carried a content chunk: nothing to measure per chunk")
    row = {"chunks": chunks, "chunk_bytes": size, "wall_s": wall, "cpu_s": cpu, "cpu_us_per_chunk": 1e6 * cpu / chunks}
    if extra_pid:
        row["engine_cpu_us_per_chunk"] = 1e6 * (cpu_seconds(extra_pid) - e0) / chunks
    return row


def run(device: str, model: str, c: int, t: int, rounds: int) -> dict:
    """Both measurements (see the module's docstring); the result as written to JSON."""
    with tempfile.TemporaryDirectory(prefix="sse-floor-") as tmp:
        return _run(Path(tmp), device, model, c, t, rounds)


def _run(tmp: Path, device: str, model: str, c: int, t: int, rounds: int) -> dict:
    from testkit.http_server import ServerProcess, free_port
    from testkit.models import model_folder

    folder = model_folder(model, tmp / "model", max_position_embeddings=4096)
    body = json.dumps({"prompt": list(range(100, 132)), "max_tokens": t, "ignore_eos": True, "stream": True,
                       "temperature": 1.0}).encode()
    server = ServerProcess([str(folder), "--device", device, "--load-format", "dummy", "--max-num-seqs", str(c),
                            "--max-model-len", "2048", "--log-level", "warning"]).start()
    try:
        ours = measure(server.port, server.proc.pid, body, c, rounds, server.engine_pid)
    finally:
        server.stop()
    # The floor streams as many chunks per request, as big, at the server's average pace per chunk.
    per_stream = max(1, round(ours["chunks"] / (c * rounds)))
    step_s = ours["wall_s"] / (rounds * per_stream)
    app_dir = tmp / "floor"
    app_dir.mkdir()
    (app_dir / "floor_app.py").write_text(FLOOR_APP)
    port = free_port()
    env = {"FLOOR_CHUNKS": str(per_stream), "FLOOR_STEP_S": f"{step_s:.6f}", "FLOOR_CHUNK_BYTES": str(ours["chunk_bytes"])}
    floor_proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "floor_app:app", "--port", str(port),
                                   "--log-level", "warning", "--no-access-log"], cwd=app_dir, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                if time.monotonic() > deadline or floor_proc.poll() is not None:
                    raise RuntimeError("the floor's uvicorn did not start") from None
                time.sleep(0.1)
        floor = measure(port, floor_proc.pid, body, c, rounds)
    finally:
        floor_proc.terminate()
        try:
            floor_proc.wait(30)
        except subprocess.TimeoutExpired:
            floor_proc.kill()
            floor_proc.wait(10)
    return {"date": now_iso(), "model": model, "device": device, "streams": c, "tokens": t, "rounds": rounds,
            "step_ms": 1e3 * step_s, "server": ours, "floor": floor,
            # None when the floor's CPU time is below the clock's tick (a tiny run)
            "server_over_floor": ours["cpu_us_per_chunk"] / floor["cpu_us_per_chunk"] if floor["cpu_s"] else None}


def allowed(us_per_chunk: float) -> str:
    return f"{1e6 / us_per_chunk:,.0f}" if us_per_chunk else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="default: llama-micro on CPU, llama-1b on CUDA")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or ("llama-1b" if args.device == "cuda" else "llama-micro")
    r = run(args.device, model, args.streams, args.tokens, args.rounds)
    ours, floor = r["server"], r["floor"]
    rows = [["server: API process", ours["chunks"], ours["chunk_bytes"], f"{ours['cpu_us_per_chunk']:.1f}",
             allowed(ours["cpu_us_per_chunk"])],
            ["floor: bare ASGI app, same uvicorn", floor["chunks"], floor["chunk_bytes"],
             f"{floor['cpu_us_per_chunk']:.1f}", allowed(floor["cpu_us_per_chunk"])]]
    print(f"\nSSE streaming cost per chunk ({model}, {args.device}, {args.streams} streams x {args.tokens} tokens, "
          f"{args.rounds} rounds, a step every {r['step_ms']:.2f} ms; engine process "
          f"{ours['engine_cpu_us_per_chunk']:.1f} us per chunk)")
    print(table(rows, ["process", "chunks", "bytes/chunk", "CPU us/chunk", "chunks/s one core allows"]))
    if r["server_over_floor"] is not None:
        print(f"server / floor: {r['server_over_floor']:.2f}x")
    if args.out is not None:
        write_json(args.out, f"sse_floor-{args.device}", r)


if __name__ == "__main__":
    main()
