"""The two container images, without a Docker engine: lint the Dockerfiles and run their install
steps for real.

hadolint is not available here, so `lint` below checks the rules this project cares about: a
pinned base image, a numeric non-root USER (the kubelet can only verify `runAsNonRoot` for a
numeric user), an exec-form ENTRYPOINT, a HEALTHCHECK decision, no ADD, pip without a cache, and
only files the .dockerignore lets into the build context. The install steps run in a fresh venv
(operator: `pip install .[operator]`, then `dtjob operator --help`, and torch must be absent) or,
for the multi-GB torch of the trainer, in the project venv (`python -m dtjob.trainer --help`, and
kopf must never be imported).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OPERATOR_DOCKERFILE = REPO / "Dockerfile"
TRAINER_DOCKERFILE = REPO / "trainer_image" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    argument: str


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions, with `\\` continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        pending.append(stripped[:-1].strip() if stripped.endswith("\\") else stripped)
        if not stripped.endswith("\\"):
            keyword, _, argument = " ".join(pending).partition(" ")
            instructions.append(Instruction(start, keyword.upper(), argument.strip()))
            pending = []
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def _image_is_pinned(image: str, stages: set[str]) -> bool:
    if image in stages or "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    return bool(name) and tag != "latest" and bool(re.search(r"\d", tag))


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.rstrip("/")
        if fnmatch.fnmatch(path, body) or path.startswith(body + "/") or fnmatch.fnmatch(path, body + "/*"):
            excluded = not negated
    return excluded


def lint(text: str, dockerignore: list[str]) -> list[str]:
    """Problems of a Dockerfile, one line each naming the line and the fix; empty when clean."""
    instructions = parse(text)
    problems: list[str] = []
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    if not froms:
        return ["no FROM instruction"]
    stages: set[str] = set()
    for ins in froms:
        words = ins.argument.split()
        image = next(w for w in words if not w.startswith("--"))
        if not _image_is_pinned(image, stages):
            problems.append(
                f"line {ins.line}: base image {image!r} is not pinned: use an explicit version tag"
            )
        if len(words) >= 3 and words[-2].upper() == "AS":
            stages.add(words[-1])
    final = final_stage(instructions)
    users = [ins for ins in final if ins.keyword == "USER"]
    if not users:
        problems.append("final stage has no USER: the image would run as root")
    else:
        user = users[-1].argument.split(":")[0]
        if not user.isdigit() or int(user) == 0:
            problems.append(f"line {users[-1].line}: USER {user!r} must be a numeric non-root uid")
    entrypoints = [ins for ins in final if ins.keyword == "ENTRYPOINT"]
    if not entrypoints:
        problems.append("final stage has no ENTRYPOINT")
    elif not entrypoints[-1].argument.startswith("["):
        problems.append(f"line {entrypoints[-1].line}: ENTRYPOINT must be exec form (a JSON list)")
    if not [ins for ins in final if ins.keyword == "HEALTHCHECK"]:
        problems.append("final stage has no HEALTHCHECK (write HEALTHCHECK NONE when none applies)")
    for ins in instructions:
        if ins.keyword == "ADD":
            problems.append(f"line {ins.line}: use COPY, not ADD")
        if (
            ins.keyword == "RUN"
            and re.search(r"\bpip install\b", ins.argument)
            and "--no-cache-dir" not in ins.argument
        ):
            problems.append(f"line {ins.line}: pip install without --no-cache-dir")
        if ins.keyword == "COPY" and "--from=" not in ins.argument:
            for source in ins.argument.split()[:-1]:
                if _dockerignore_excludes(source.rstrip("/"), dockerignore):
                    problems.append(f"line {ins.line}: COPY {source} is excluded by .dockerignore")
    return problems


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, TRAINER_DOCKERFILE], ids=["operator", "trainer"])
def test_dockerfile_passes_lint(dockerfile: Path) -> None:
    assert lint(dockerfile.read_text(), dockerignore()) == []


def test_lint_catches_each_rule() -> None:
    bad = "\n".join(
        [
            "FROM python:latest AS build",
            "FROM ubuntu",
            "ADD https://example.com/x.tgz /x",
            "COPY tests/ /tests/",
            "RUN pip install \\",
            "    dtjob",
            "USER trainer",
            "ENTRYPOINT python -m dtjob.trainer",
        ]
    )
    problems = "\n".join(lint(bad, dockerignore()))
    for expected in [
        "line 1: base image 'python:latest' is not pinned",
        "line 2: base image 'ubuntu' is not pinned",
        "line 3: use COPY, not ADD",
        "line 4: COPY tests/ is excluded by .dockerignore",
        "line 5: pip install without --no-cache-dir",
        "line 7: USER 'trainer' must be a numeric non-root uid",
        "line 8: ENTRYPOINT must be exec form",
        "no HEALTHCHECK",
    ]:
        assert expected in problems
    assert "USER '0' must be a numeric non-root uid" in "\n".join(
        lint("FROM python:3.11.11-slim\nUSER 0\n", [])
    )
    # A USER in a build stage does not cover the final stage.
    two_stages = "FROM python:3.11.11-slim AS build\nUSER 1000\nFROM python:3.11.11-slim\n"
    assert "final stage has no USER" in "\n".join(lint(two_stages, []))


def _final(dockerfile: Path, keyword: str) -> list[Instruction]:
    return [ins for ins in final_stage(parse(dockerfile.read_text())) if ins.keyword == keyword]


def test_images_run_the_right_entry_points_and_extras() -> None:
    operator_text = OPERATOR_DOCKERFILE.read_text()
    trainer_text = TRAINER_DOCKERFILE.read_text()
    assert json.loads(_final(OPERATOR_DOCKERFILE, "ENTRYPOINT")[-1].argument) == ["dtjob", "operator"]
    assert json.loads(_final(TRAINER_DOCKERFILE, "ENTRYPOINT")[-1].argument) == [
        "python",
        "-m",
        "dtjob.trainer",
    ]
    assert "[operator]" in operator_text and "[trainer]" not in operator_text
    assert "[trainer]" in trainer_text and "[operator]" not in trainer_text
    assert "slim" in _final_from(OPERATOR_DOCKERFILE)
    assert "torch==${TORCH_VERSION}" in trainer_text


def test_trainer_image_torch_is_the_tested_one_and_satisfies_the_floor() -> None:
    """The torch the image ships is the one CI runs every test with (constraints.txt), and the
    [trainer] extra's floor admits it."""
    import tomllib

    import torch
    from packaging.requirements import Requirement

    [arg] = [i.argument for i in _final(TRAINER_DOCKERFILE, "ARG") if i.argument.startswith("TORCH_VERSION=")]
    image_torch = arg.split("=", 1)[1]
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert f"torch=={image_torch}" in constraints
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [floor] = [Requirement(r) for r in extras["trainer"] if r.startswith("torch")]
    assert floor.specifier.contains(image_torch), f"image torch {image_torch} outside {floor}"
    assert torch.__version__.split("+")[0] == image_torch, "the tests ran with another torch than the image's"


def _final_from(dockerfile: Path) -> str:
    return final_stage(parse(dockerfile.read_text()))[0].argument


def test_image_users_match_the_chart_security_contexts() -> None:
    values = yaml.safe_load((REPO / "helm" / "dtjob" / "values.yaml").read_text())
    operator_uid = int(_final(OPERATOR_DOCKERFILE, "USER")[-1].argument.split(":")[0])
    trainer_uid = int(_final(TRAINER_DOCKERFILE, "USER")[-1].argument.split(":")[0])
    assert values["podSecurityContext"]["runAsUser"] == operator_uid
    # Workers: no uid forced, runAsNonRoot verified against the image's numeric USER.
    assert values["workers"]["podSecurityContext"]["runAsNonRoot"] is True
    assert "runAsUser" not in values["workers"]["podSecurityContext"]
    assert trainer_uid == 1000, "the chart's values.yaml (workers.podSecurityContext) documents uid 1000"
    ports = {int(p) for ins in _final(OPERATOR_DOCKERFILE, "EXPOSE") for p in ins.argument.split()}
    assert {values["operator"]["healthPort"], values["operator"]["metricsPort"]} <= ports


def _no_module(python: Path, module: str) -> bool:
    result = subprocess.run(
        [str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    return result.returncode != 0 and f"No module named '{module}'" in result.stderr


@pytest.mark.slow
def test_operator_install_step_in_a_fresh_venv(tmp_path: Path) -> None:
    """The operator image's pip step, for real: the [operator] extra alone runs `dtjob operator`."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{REPO}[operator]"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    usage = subprocess.run(
        [str(env_dir / "bin" / "dtjob"), "operator", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert usage.returncode == 0, usage.stderr
    assert "--all-namespaces" in usage.stdout and "--namespace" in usage.stdout
    # The installed copy is used, not the checkout, and torch is neither installed nor needed.
    where = subprocess.run(
        [str(python), "-c", "import dtjob.operator.main as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(env_dir)), where.stdout
    assert _no_module(python, "torch")


def test_trainer_entry_point_starts_and_never_imports_kopf() -> None:
    usage = subprocess.run(
        [sys.executable, "-m", "dtjob.trainer", "--help"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 0, usage.stderr
    assert "--strategy" in usage.stdout
    # Import every module of the trainer package (what any run may load) in a fresh interpreter:
    # neither kopf nor the kubernetes client may come along.
    probe = (
        "import importlib, pkgutil, sys\n"
        "import dtjob.trainer as t\n"
        "names = [m.name for m in pkgutil.walk_packages(t.__path__, 'dtjob.trainer.')]\n"
        "[importlib.import_module(n) for n in names if not n.endswith('__main__')]\n"
        "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    count, imported = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 5, "the trainer package looks empty"
    assert imported == "[]"
