"""Build csrc/sleep_alloc.c into allocator/_lib/libsleep_alloc.so.

    python -m allocator.build                 # build, fail loudly if it cannot
    python -m allocator.build --if-possible   # exit 0 with a message where cc or cuda.h is missing
    python -m allocator.build --strict        # -Wall -Wextra -Werror (what the tests use)

The library holds no Python or torch symbols, so one build serves every Python version on the
machine. The CUDA backend calls ensure_library(), which rebuilds when the .so is missing or older
than its source (a checkout copied to a GPU host arrives without the ignored _lib/ folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE = PACKAGE_DIR.parent / "csrc" / "sleep_alloc.c"
LIBRARY = PACKAGE_DIR / "_lib" / "libsleep_alloc.so"

BASE_FLAGS = ["-O2", "-std=c11", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall"]
STRICT_FLAGS = ["-Wextra", "-Werror"]


class BuildError(RuntimeError):
    """The C library could not be built; the message says why."""


class NotBuildable(BuildError):
    """This machine lacks what the build needs (compiler, CUDA headers or the C source)."""


@dataclass(frozen=True)
class Toolchain:
    compiler: str
    cuda_include: Path


def find_compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def find_cuda_include() -> Path | None:
    """The first folder holding cuda.h: $CUDA_HOME, $CUDA_PATH, nvcc's, /usr/local/cuda, then
    the headers a pip-installed CUDA toolkit ships (found by cuda-pathfinder)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return Path(root) / "include"
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        found = find_nvidia_header_directory("cudart")
    except Exception:  # pathfinder raises assorted errors when nothing is installed
        return None
    if found and (Path(found) / "cuda.h").is_file():
        return Path(found)
    return None


def find_toolchain() -> Toolchain:
    compiler = find_compiler()
    include = find_cuda_include()
    missing = []
    if compiler is None:
        missing.append("a C compiler (cc/gcc/clang, or set $CC)")
    if include is None:
        missing.append("the CUDA headers (cuda.h; set $CUDA_HOME to the toolkit root)")
    if missing:
        raise NotBuildable(f"cannot build {LIBRARY.name}: missing {' and '.join(missing)}")
    assert compiler is not None and include is not None
    return Toolchain(compiler, include)


def build(strict: bool = False, output: Path = LIBRARY) -> Path:
    """Compile the library into `output` atomically (concurrent builders never see half a file)."""
    if not SOURCE.is_file():
        raise NotBuildable(f"cannot build {output.name}: source {SOURCE} is missing")
    tools = find_toolchain()
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=output.parent)
    os.close(fd)
    flags = BASE_FLAGS + (STRICT_FLAGS if strict else [])
    cmd = [tools.compiler, *flags, f"-I{tools.cuda_include}", str(SOURCE), "-o", tmp, "-ldl", "-lpthread"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(
                f"compiling {SOURCE.name} failed (exit {result.returncode}):\n"
                f"$ {' '.join(cmd)}\n{result.stderr.strip()}"
            )
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def is_stale(library: Path = LIBRARY) -> bool:
    if not library.is_file():
        return True
    return SOURCE.is_file() and SOURCE.stat().st_mtime > library.stat().st_mtime


def ensure_library() -> Path:
    """The path of an up-to-date library, building it first when missing or stale."""
    if is_stale():
        build()
    return LIBRARY


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m allocator.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--if-possible", action="store_true",
                        help="exit 0 with a message when no compiler or CUDA headers are present")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    args = parser.parse_args(argv)
    try:
        path = build(strict=args.strict)
    except BuildError as err:
        if args.if_possible and isinstance(err, NotBuildable):
            print(f"allocator.build: skipped ({err}); the CPU backend works without it")
            return 0
        print(f"allocator.build: {err}", file=sys.stderr)
        return 1
    print(f"allocator.build: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
