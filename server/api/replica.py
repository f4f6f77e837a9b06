"""One API process after the first (--api-server-count): `python -m server.api.replica ...`, started by
OtherApiServers (servers.py) with its ServerSettings pickled on stdin. It connects to the engine over the
socket the engine process was given for it, and serves HTTP on the shared listening socket."""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys

from server.api.engine_client import EngineClient
from server.api.metrics import share_metrics
from server.api.tokens import TokenizerPreload
from server.logging_setup import configure_logging
from server.process_death import die_with_parent

log = logging.getLogger("sleepserve.server")


def main(argv: list[str] | None = None) -> int:
    """One API process after the first: `python -m server.api.replica ...`, started by OtherApiServers.start,
    its ServerSettings pickled on stdin."""
    ap = argparse.ArgumentParser(prog="python -m server.api.replica",
                                 description="one of sleepserve's extra API processes (--api-server-count)")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--engine-fd", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--metrics-dir", required=True)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    die_with_parent(args.parent)
    settings = pickle.loads(sys.stdin.buffer.read())
    # Started before the web stack is imported: it loads while the engine does (this process waits for its Ready).
    preload = TokenizerPreload(args.model)
    from server.api.app import create_app, run_http


    configure_logging(settings.log_level)
    share_metrics(args.metrics_dir)  # before create_app makes the metrics
    try:  # the first process starts this one while the engine loads: its Ready comes on this channel
        engine = EngineClient.connect(socket.socket(fileno=args.engine_fd))
    except (EOFError, OSError):  # the engine did not start: the first process says why and exits 1
        return 1
    log.info("API process %d (pid %d) serves beside pid %d", args.index, os.getpid(), args.parent)
    app = create_app(engine, settings, metrics_dir=args.metrics_dir, preload=preload)

    def started() -> None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    return run_http(app, engine, settings, socket.socket(fileno=args.listen_fd), on_started=started)


if __name__ == "__main__":
    sys.exit(main())
