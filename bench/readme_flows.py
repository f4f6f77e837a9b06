"""The README's sleep-mode curl blocks, run verbatim against the real HTTP server.

Each ```bash block of README.md's "Sleep and wake" section is one flow. Per flow: a request is sent
right after the block's first command (the server is then asleep or paused: it must be held and
served afterwards); for a flow that pauses with mode=keep, a long stream is also in flight before it.
Every command must answer 200; after the flow the server must be fully awake (no tag asleep, the
internal CUDA-graph tag included), the held request and the stream must be served to the end, and
every greedy output of a request that ran alone must equal the one before any flow ran.
Timings per command are printed and written to --out.

    python bench/readme_flows.py --out $OUT     # CUDA: a 1.24 B Llama, random weights (--load-format dummy)
    python bench/readme_flows.py --device cpu   # the same flows on the CPU backend (embedded model)

The commands run under bash with `localhost:8000` pointed at the test server's port and curl told to
print the status code; nothing else in them is changed.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402
from testkit.models import model_folder  # noqa: E402
from testkit.http_server import REPO, ServerProcess  # noqa: E402

PROMPT = "The three most important ideas in the history of science are"


def readme_flows(readme: Path) -> list[tuple[str, list[str]]]:
    """(title, commands) per ```bash block of the "Sleep and wake" section; a command's trailing
    comment stays (bash ignores it), continuation lines are joined."""
    text = readme.read_text()
    section = text[text.index("## Sleep and wake"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    flows = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        lines = block.replace("\\\n", " ").splitlines()
        title = next((ln.lstrip("# ").strip() for ln in lines if ln.startswith("#")), "flow")
        commands = [ln.strip() for ln in lines if ln.strip().startswith("curl ")]
        if commands:
            flows.append((title, commands))
    return flows


def run_curl(command: str, port: int) -> tuple[int, str, float]:
    """Run one README command verbatim, but against our port, with curl reporting the status code."""
    command = command.replace("localhost:8000", f"127.0.0.1:{port}")
    command = "curl -sS -w '\\n%{http_code}' " + command[len("curl "):]
    t = time.perf_counter()
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t
    body, _, code = out.stdout.rpartition("\n")
    return int(code or 0), body.strip(), seconds


class Request(threading.Thread):
    """A completion in a thread (held while asleep, or in flight during a pause)."""

    def __init__(self, server: ServerProcess, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.status, self.text, self.finish = 0, "", None

    def run(self) -> None:
        with self.server.client(timeout=900) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                                                 "ignore_eos": True})
        self.status = r.status_code
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            self.text, self.finish = choice["text"], choice["finish_reason"]


def complete(server: ServerProcess, max_tokens: int) -> str:
    req = Request(server, max_tokens)
    req.run()
    assert req.status == 200, f"completion answered {req.status}"
    return req.text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()

    flows = readme_flows(REPO / "README.md")
    assert len(flows) >= 3, f"expected the README's sleep flows, found {[t for t, _ in flows]}"
    if args.device == "cuda":
        folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        serve = [str(folder), "--device", "cuda", "--load-format", "dummy", "--max-model-len", "4096"]
    else:
        serve = ["--device", "cpu", "--kv-cache-memory", "256MiB", "--max-model-len", "1024"]
    server = ServerProcess([*serve, "--dev-mode"]).start()
    result: dict = {"date": now_iso(), "device": args.device, "model": args.model if args.device == "cuda"
                    else "SmolLM2-135M", "flows": []}
    failures: list[str] = []
    rows = []
    long_tokens = 512 if args.device == "cuda" else 48
    try:
        complete(server, 8)  # warm-up
        reference = complete(server, 32)
        reference_long = complete(server, long_tokens)
        for title, commands in flows:
            flow: dict = {"title": title, "commands": []}
            in_flight = None
            if "pause?mode=keep" in commands[0]:
                in_flight = Request(server, long_tokens)
                in_flight.start()
                time.sleep(0.5 if args.device == "cuda" else 2.0)  # it is decoding when the pause lands
            held = None
            for i, command in enumerate(commands):
                code, body, seconds = run_curl(command, server.port)
                flow["commands"].append({"command": command, "status": code, "seconds": seconds})
                rows.append([title[:28], command.split("#")[0].strip()[:88], code, f"{seconds * 1e3:.0f} ms"])
                if code != 200:
                    failures.append(f"{title}: {command} answered {code}: {body[:300]}")
                if i == 0:  # asleep or paused now: this request must wait and be served afterwards
                    held = Request(server, 32)
                    held.start()
            state = json.loads(run_curl("curl localhost:8000/is_sleeping", server.port)[1])
            flow["state_after"] = state
            if state["is_sleeping"] or any(s != "awake" for s in state["tag_states"].values()) \
                    or not state["weights_valid"]:
                failures.append(f"{title}: not fully awake after the flow: {state}")
            # A request that ran alone must give the reference text exactly. Two that ran together after a
            # resume ran at batch size 2, whose GEMM shapes differ from the reference's (bf16 results then
            # may differ in the last bits, and greedy decoding of random weights can follow them): there
            # the text is reported, and what must hold is that both were served to the end.
            alone = in_flight is None
            for name, req, want in (("held request", held, reference), ("in-flight stream", in_flight, reference_long)):
                if req is None:
                    continue
                req.join(900)
                same = req.text == want
                flow[name] = {"status": req.status, "same_output": same, "finish_reason": req.finish}
                if req.status != 200 or req.finish != "length" or (alone and not same):
                    failures.append(f"{title}: {name} answered {req.status} ({req.finish}), same output: {same}")
            after = complete(server, 32)
            flow["same_output_after"] = after == reference
            if after != reference:
                failures.append(f"{title}: greedy output changed after the flow")
            result["flows"].append(flow)
    finally:
        server.stop()
    result["failures"] = failures
    write_json(args.out, f"readme_flows_{args.device}", result)
    print(f"README sleep flows through HTTP ({result['model']}, {args.device})")
    print(table(rows, ["flow", "command", "status", "time"]))
    for flow in result["flows"]:
        print(f"{flow['title']}: fully awake after: {not flow['state_after']['is_sleeping']}, same greedy output: "
              f"{flow['same_output_after']}, held request: {flow.get('held request')}, "
              f"in-flight stream: {flow.get('in-flight stream')}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all README flows passed")


if __name__ == "__main__":
    main()
