"""Sampling profiles of the server's processes while a benchmark pass runs (py-spy, from PyPI).

Where a pass through HTTP falls short of the in-process engine, the question is which process sets the pace:
the API (HTTP, SSE framing, socket writes), the engine (its steps, or waiting for work), or neither (then the
clients). `Spy` records each given process with py-spy for the length of one pass — idle samples included, so a
thread that waits shows where it waits, where asked — and summarizes each thread as its share of the samples and its
hottest innermost frames. Non-blocking sampling: the processes are never paused, so the pass runs as without it.

    spy = Spy(Path("out/spy"), "stream-64", {"api": api_pid, "engine": engine_pid}, idle={"engine"})
    ... the pass ...
    summary = spy.stop()   # {"api": {"cpu_cores": ..., "samples": ..., "threads": {thread: {"share", "top"}}}, ...}

Where one thread's time goes under one of its frames (how the engine thread's streaming work was found):

    python -m bench.spy results/serve-spy/spy/0[012]-*-engine.txt --thread sleepserve-engine \
        --below EngineCore._step_async,EngineServer.run --depth 2
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Collection


def py_spy() -> str:
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("--spy needs py-spy on PATH (pip install py-spy; on the GPU host, carry its wheel in .whl)")
    return found


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads) so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Spy:
    """idle: also sample waiting threads (where a thread waits). Without it the samples are the busy ones only:
    for an event loop, whose wait and whose C work (uvloop, socket writes) both sit in one Python frame, that is
    the way to see its work. Either way `cpu_cores` (CPU seconds ÷ wall seconds, every thread) says how busy."""

    def __init__(self, folder: Path, name: str, pids: dict[str, int], idle: Collection[str] = (), rate: int = 250,
                 under: dict[str, tuple[str, list[str]]] | None = None):
        """under: proc -> (thread, anchors): stop() also breaks that thread's samples down below the anchors (below())."""
        self.under = under or {}
        folder.mkdir(parents=True, exist_ok=True)
        self.files = {proc: folder / f"{name}-{proc}.txt" for proc in pids}
        self.logs = {proc: folder / f"{name}-{proc}.log" for proc in pids}  # py-spy's own messages
        self.pids = dict(pids)
        self._cpu0 = {proc: cpu_seconds(pid) for proc, pid in pids.items()}
        self._t0 = time.monotonic()
        self._procs = []
        for proc, pid in pids.items():
            with open(self.logs[proc], "wb") as log:
                self._procs.append(subprocess.Popen(
                    [py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                     *(["--idle"] if proc in idle else []), "--threads", "--nonblocking", "-o", str(self.files[proc])],
                    stdout=log, stderr=subprocess.STDOUT))

    def stop(self) -> dict:
        """Each process's profile; {"error": py-spy's last words} for one it could not record (no ptrace
        permission, the process gone)."""
        wall = time.monotonic() - self._t0
        cpu1 = {}
        for proc, pid in self.pids.items():
            try:
                cpu1[proc] = cpu_seconds(pid)
            except (OSError, IndexError, ValueError):  # the process is gone: no figure, and no error of ours
                pass
        for p in self._procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        out = {}
        for proc, path in self.files.items():
            cores = round((cpu1[proc] - self._cpu0[proc]) / wall, 2) if proc in cpu1 else None
            if path.exists():
                out[proc] = {"cpu_cores": cores, **summarize(path)}
                if proc in self.under:
                    thread, anchors = self.under[proc]
                    n, counts = below([path], thread, anchors)
                    out[proc]["below"] = {"thread": thread, "anchor": anchors[0], "samples": n,
                                          "top": [[k, round(v / max(n, 1), 3)] for k, v in counts.most_common(6)]}
            else:
                said = self.logs[proc].read_text(errors="replace").strip().splitlines()
                out[proc] = {"cpu_cores": cores, "error": " ".join(said[-3:]) or "py-spy wrote no profile"}
        return out


ROOT = re.compile(r"(thread \(\d+\))(?::\s*(.*))?")


def stacks(path: Path):
    """py-spy's raw file as (stack's frames, root first: with --threads `thread (id): name`; samples), one a
    distinct stack; lines that are not a stack are skipped."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def summarize(path: Path, top: int = 5) -> dict:
    """Per thread (py-spy's root frame: `thread (id): name`, or the id alone before the name is known): its
    share of the samples and its `top` innermost frames, each as a share of that thread's samples (with idle
    sampling, a thread's wait is one of them)."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    names: dict[str, str] = {}
    for parts, count in stacks(path):
        m = ROOT.fullmatch(parts[0])
        key = m.group(1) if m else parts[0]
        if m and m.group(2):
            names[key] = m.group(2)
        threads[key][parts[-1]] += count
    total = sum(sum(c.values()) for c in threads.values())
    out = {}
    for key, frames in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(frames.values())
        out[f"{key}: {names[key]}" if key in names else key] = {
            "share": round(n / total, 3), "top": [[f, round(k / n, 3)] for f, k in frames.most_common(top)]}
    return {"samples": total, "threads": out}


def frame_name(frame: str) -> str:
    """py-spy's raw frame `function (file:line)` without its place."""
    return frame.split(" (", 1)[0]


def below(paths: list[Path], thread: str, anchors: list[str], depth: int = 2,
          skip: tuple[str, ...] = ("Event.wait",)) -> tuple[int, collections.Counter]:
    """The samples of the thread named `thread` in py-spy raw files, each counted under the `depth` frames below
    the first of `anchors` (in order of preference) its stack holds; stacks holding none, or a frame of `skip`
    (an idle loop's wait), are left out. Returns (samples counted, Counter of "frame;frame" -> samples)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for path in paths:
        for frames, count in stacks(path):
            m = ROOT.fullmatch(frames[0])
            if not (m and m.group(2) == thread):
                continue
            names = [frame_name(f) for f in frames[1:]]
            if any(s in names for s in skip):
                continue
            at = next((names.index(a) for a in anchors if a in names), None)
            if at is None:
                continue
            total += count
            counts[";".join(names[at + 1:at + 1 + depth])] += count
    return total, counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Where a thread's samples go below a frame (py-spy raw files)")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--thread", required=True, help="the thread's name, as py-spy records it")
    ap.add_argument("--below", required=True, help="comma-separated frames, the first found in a stack counts")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    total, counts = below(args.files, args.thread, args.below.split(","), args.depth)
    print(f"{total} samples of {args.thread} below {args.below}")
    for frames, n in counts.most_common(args.top):
        print(f"{n / max(total, 1):6.1%}  {frames or '(the frame itself)'}")


if __name__ == "__main__":
    main()
