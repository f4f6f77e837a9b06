"""Starting the engine process, before the API process has imported anything heavy.

Standard library only: `sleepserve serve` spawns the engine first thing, so the engine's imports (torch, the
model code) run while the API process imports its own (FastAPI, torch, the tokenizer). On the 2-core CI host a
server answered /health 7.0 s after it was started when the engine was spawned after those imports.
EngineClient.launch then sends the engine its Start and waits for Ready.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class SpawnedEngine:
    proc: subprocess.Popen
    mine: socket.socket             # the first API process's end of its channel
    spare: list[socket.socket]      # the other API processes' ends (--api-server-count)

    def kill(self) -> None:
        """The server will not start after all (a bad flag): end the engine before it loads anything."""
        self.mine.close()
        for s in self.spare:
            s.close()
        self.proc.kill()
        self.proc.wait()


def spawn_engine(channels: int = 1) -> SpawnedEngine:
    """The engine process, started and waiting for its Start on the first of `channels` socket pairs."""
    pairs = [socket.socketpair() for _ in range(channels)]
    fds = [theirs.fileno() for _, theirs in pairs]
    cmd = [sys.executable, "-m", "server.engine.process", "--fd", ",".join(map(str, fds)), "--parent", str(os.getpid())]
    proc = subprocess.Popen(cmd, pass_fds=fds)
    for _, theirs in pairs:
        theirs.close()
    return SpawnedEngine(proc, pairs[0][0], [ours for ours, _ in pairs[1:]])
