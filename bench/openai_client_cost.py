"""What the official `openai` client (httpx under it) costs by itself at high concurrency, and beside it the
clients bench/serve.py can load a server with.

A stand-in server that answers at once (canned completions, no model, several processes on one port; streams
in chunked encoding, an event per chunk, as uvicorn sends them) takes `--concurrency` requests at a time from
one client in this process, plain and streamed (`--chunks` content chunks per answer, as a stream of that many
tokens sends at --stream-interval 1). The clients (bench/serve.py CLIENTS): typed, the `openai` client as a user
calls it; raw, the same client with its typed models bypassed; fast, bench/fast_client.py. Printed per client
and mode: requests/s, the client process's CPU seconds per request (and per streamed chunk), and the stand-in's
own CPU per request (small: the client is what is measured). Read beside bench/serve.py's HTTP results: a
client that needs this much CPU per request limits what any server behind it can deliver.

    python bench/openai_client_cost.py                                  # 256 at once, 256-chunk streams
    python bench/openai_client_cost.py --concurrency 64 --chunks 32 --rounds 2 --clients typed,fast
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import sys
import time
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402

MODEL = "instant"


def _completion(chunks: int) -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "text": " x" * chunks, "logprobs": None, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 32, "completion_tokens": chunks,
                                 "total_tokens": 32 + chunks}}).encode()


def _stream(chunks: int) -> bytes:
    def event(text: str, finish: str | None) -> bytes:
        return b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                                       "choices": [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": finish}]}).encode() + b"\n\n"
    events = [event(" x", None) for _ in range(chunks - 1)] + [event(" x", "length"), b"data: [DONE]\n\n"]
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _serve(sock: socket.socket, chunks: int) -> None:
    """One stand-in process: HTTP/1.1 keep-alive, each request answered from memory as soon as it is read."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    plain, stream = _completion(chunks), _stream(chunks)
    plain_head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                  + str(len(plain)).encode() + b"\r\n\r\n")
    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                if b'"stream":true' in body.replace(b" ", b""):
                    writer.write(stream_head + stream)
                else:
                    writer.write(plain_head + plain)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


async def _round(client, kind: str, concurrency: int, stream: bool) -> tuple[float, int]:
    """One burst of `concurrency` requests at once; (wall seconds, content chunks received)."""
    from bench.serve import CLIENTS

    answer, chunks = CLIENTS[kind]
    args = {"model": MODEL, "prompt": "x", "max_tokens": 8}

    async def one() -> int:
        if not stream:
            return 1 if await answer(client, args) > 0 else 0
        n = 0
        async for choice, _ in chunks(client, {**args, "stream": True}):
            n += bool(choice and choice[1])
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(concurrency)))
    return time.perf_counter() - t0, sum(counts)


async def _measure(root: str, kind: str, concurrency: int, rounds: int, stream: bool, server_cpu) -> dict:
    if kind == "fast":
        from bench.fast_client import FastClient

        client = FastClient(root, "unused", timeout=120)
    else:
        import openai

        client = openai.AsyncOpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=120)
    await _round(client, kind, concurrency, stream)  # warm-up: connections opened, code paths imported
    walls, chunks = [], 0
    cpu0, srv0 = _cpu_s(), server_cpu()
    for _ in range(rounds):
        wall, n = await _round(client, kind, concurrency, stream)
        walls.append(wall)
        chunks += n
    cpu, srv = _cpu_s() - cpu0, server_cpu() - srv0
    await client.close()
    requests = concurrency * rounds
    return {"client": kind, "mode": "stream" if stream else "plain", "requests": requests, "received": chunks,
            "median_burst_s": statistics.median(walls),
            "requests_per_s": requests / sum(walls), "client_cpu_ms_per_request": 1e3 * cpu / requests,
            "client_cpu_us_per_chunk": 1e6 * cpu / chunks if stream and chunks else None,
            "client_cores_busy": cpu / sum(walls), "server_cpu_ms_per_request": 1e3 * srv / requests}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=256, help="content chunks per streamed answer (tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="typed,raw,fast", help="bench/serve.py CLIENTS to measure, comma-separated")
    ap.add_argument("--server-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    procs = [Process(target=_serve, args=(sock, args.chunks), daemon=True) for _ in range(args.server_processes)]
    for p in procs:
        p.start()

    def server_cpu() -> float:
        total = 0.0
        for p in procs:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    try:
        root = f"http://127.0.0.1:{port}"
        rows = [asyncio.run(_measure(root, kind, args.concurrency, args.rounds, stream, server_cpu))
                for kind in args.clients.split(",") for stream in (False, True)]
    finally:
        for p in procs:
            p.kill()
    result = {"date": now_iso(), "concurrency": args.concurrency, "chunks": args.chunks,
              "server_processes": args.server_processes, "rows": rows}
    write_json(args.out, "openai-client-cost", result)
    print(f"\nclients alone (typed, raw: {_openai_version()}, httpx; fast: bench/fast_client.py): "
          f"{args.concurrency} requests at once, {args.chunks}-chunk streams, against an instant stand-in "
          f"({args.server_processes} processes)")
    print(table([[r["client"], r["mode"], f"{r['requests_per_s']:.0f}", f"{r['client_cpu_ms_per_request']:.2f}",
                  f"{r['client_cpu_us_per_chunk']:.1f}" if r["client_cpu_us_per_chunk"] else "-",
                  f"{r['client_cores_busy']:.2f}", f"{r['server_cpu_ms_per_request']:.3f}"] for r in rows],
                ["client", "mode", "requests/s", "client CPU ms/request", "client CPU us/chunk", "client cores busy",
                 "stand-in CPU ms/request"]))


def _openai_version() -> str:
    import openai
    return f"openai {openai.__version__}"


if __name__ == "__main__":
    main()
