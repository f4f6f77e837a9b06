"""Runs a snippet under Triton's CPU interpreter, in a fresh process: TRITON_INTERPRET is read when a
kernel is defined, so it cannot be switched on inside a process that already imported the kernels."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(code: str, timeout: float = 300) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def compile_for_sm90(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...] = (), **options):
    """A Triton kernel through the compiler's whole pipeline to an sm_90 cubin, as on the H200, without a GPU
    (the interpreter is lenient about types and shapes; the compiler is not). Skips where Triton ships no ptxas.
    divisible: the arguments to mark multiples of 16 (a pointer: 16-byte aligned), as the JIT marks them at a
    call whose values are; without them no load can be an asynchronous copy, and no loop is software-pipelined."""
    import pytest
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexpr parameters left out take their defaults, as a JIT call's do
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constexprs
                and p.name not in signature and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    try:
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"no ptxas with this Triton: {e}")
        raise
    assert kernel.asm["cubin"]
    return kernel


def waits_before_memory(ptx: str) -> bool:
    """A chained kernel's PTX: it lets the next kernel launch and waits for the one before (griddepcontrol)
    before its first global load, store or asynchronous copy."""
    import re

    lines = [line.strip() for line in ptx.splitlines()]
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    launch = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), None)
    memory = re.compile(r"^(@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")
    first = next((i for i, line in enumerate(lines) if memory.match(line)), None)
    return None not in (wait, launch, first) and launch < first and wait < first


def ptxas_usage(kernel) -> tuple[int, int]:
    """(registers a thread, spill store bytes) of a compile_for_sm90 kernel, from `ptxas -v` (Triton's own
    ptxas) on its PTX: register pressure and spills are decided there, so this reads them without a GPU."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia.compiler as nvidia

    found = nvidia.get_ptxas(90)
    ptxas = getattr(found, "path", found[0] if isinstance(found, tuple) else found)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        said = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", said).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", said).group(1))
    return registers, spills
