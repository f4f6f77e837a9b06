"""The layout's promises, checked on the source: the API process's modules and the wire load no torch and
no engine, and no import circle joins library modules (imports inside functions count too)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_process_imports_no_torch_and_no_engine():
    code = ("import sys, server.api.app, server.api.servers, server.api.replica, server.wire.messages\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'server.engine', 'allocator')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the API process imported {out.stdout.strip()}"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("server", "allocator"):
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_circles():
    mods = _modules()
    edges = {m: _imports(m, p, mods) for m, p in mods.items()}
    circles = []
    for start in edges:  # a path back to start through the edges is a circle
        seen, stack = set(), [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    circles.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert not circles, f"import circles: {sorted(set(min(c) for c in circles))} e.g. {' -> '.join(circles[0])}"


# Each layer may import only these (besides itself): api -> wire <- engine -> model -> allocator.
ALLOWED = {
    "wire": {"config"},
    "model": {"wire", "config", "allocator"},
    "weight_transfer": {"wire", "config", "allocator"},
    "engine": {"model", "weight_transfer", "wire", "config", "allocator", "heap", "logging_setup", "process_death"},
    "api": {"wire", "config", "model.tokenizer", "model.source", "model.default_model", "heap", "logging_setup",
            "process_death", "server"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "allocator" if parts[0] == "allocator" else parts[1] if len(parts) > 1 else "server"


def test_layers_import_only_downward():
    mods = _modules()
    wrong = []
    for m, p in mods.items():
        allowed = ALLOWED.get(_layer(m))
        if allowed is None:
            continue
        for dep in _imports(m, p, mods):
            layer = _layer(dep)
            sub = ".".join(dep.split(".")[1:3])
            if layer != _layer(m) and layer not in allowed and sub not in allowed:
                wrong.append(f"{m} -> {dep}")
    assert not wrong, "imports against the layers: " + "; ".join(wrong)
