"""The cluster's upstream binaries: which versions (devcluster/versions.env), where they are cached
($DTJOB_CACHE/bin/<project>-v<version>/), and building the missing ones with build-binaries.sh.
Volcano's (`up --volcano`) are built only when asked for (`build-binaries.sh --volcano`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtjob.devcluster.errors import DevclusterError

DEVCLUSTER_SOURCE = Path(__file__).resolve().parents[2]
VERSIONS_FILE = DEVCLUSTER_SOURCE / "versions.env"
BUILD_SCRIPT = DEVCLUSTER_SOURCE / "build-binaries.sh"
K8S_TOOLS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
VOLCANO_TOOLS = ("vc-scheduler", "vc-controller-manager")


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """KEY=VALUE lines of versions.env (comments and blank lines ignored)."""
    versions: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise DevclusterError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        versions[key.strip()] = value.strip().strip("\"'")
    return versions


def cache_dir() -> Path:
    """Same default as build-binaries.sh and the Makefile."""
    return Path(os.environ.get("DTJOB_CACHE") or Path.home() / ".cache" / "dtjob")


@dataclass(frozen=True)
class Binaries:
    kubernetes_version: str
    etcd_version: str
    helm_version: str
    cache: Path
    volcano_version: str = ""

    @classmethod
    def pinned(cls) -> Binaries:
        v = read_versions()
        try:
            return cls(
                v["KUBERNETES_VERSION"],
                v["ETCD_VERSION"],
                v["HELM_VERSION"],
                cache_dir(),
                v["VOLCANO_VERSION"],
            )
        except KeyError as missing:
            raise DevclusterError(f"{VERSIONS_FILE} does not pin {missing.args[0]}") from None

    @property
    def k8s_dir(self) -> Path:
        return self.cache / "bin" / f"k8s-v{self.kubernetes_version}"

    @property
    def etcd_dir(self) -> Path:
        return self.cache / "bin" / f"etcd-v{self.etcd_version}"

    @property
    def helm_dir(self) -> Path:
        return self.cache / "bin" / f"helm-v{self.helm_version}"

    @property
    def volcano_dir(self) -> Path:
        """vc-scheduler, vc-controller-manager, and the release's crd/ and config/."""
        return self.cache / "bin" / f"volcano-v{self.volcano_version}"

    def volcano_path(self, tool: str) -> Path:
        if tool not in VOLCANO_TOOLS:
            raise ValueError(f"unknown Volcano binary {tool!r}")
        return self.volcano_dir / tool

    def path(self, tool: str) -> Path:
        if tool == "etcd":
            return self.etcd_dir / "etcd"
        if tool == "helm":
            return self.helm_dir / "helm"
        if tool in K8S_TOOLS:
            return self.k8s_dir / tool
        raise ValueError(f"unknown cluster binary {tool!r}")

    def all_paths(self) -> list[Path]:
        return [self.path(t) for t in ("etcd", *K8S_TOOLS, "helm")]

    def missing(self, volcano: bool = False) -> list[Path]:
        """Binaries not cached; with volcano, Volcano's too (and its CRD directory)."""
        paths = self.all_paths()
        if volcano:
            paths += [self.volcano_path(t) for t in VOLCANO_TOOLS]
        gone = [p for p in paths if not os.access(p, os.X_OK)]
        if volcano and not (self.volcano_dir / "crd").is_dir():
            gone.append(self.volcano_dir / "crd")
        return gone

    def check_buildable(self, volcano: bool = False) -> None:
        """Fail fast, before anything starts, when a binary is missing and cannot be built."""
        missing = self.missing(volcano)
        if not missing:
            return
        if shutil.which("go") is None:
            raise DevclusterError(
                f"the Go toolchain is missing and {len(missing)} cluster binaries are not cached "
                f"in {self.cache / 'bin'}; install Go >= 1.26 (on PATH as `go`) and run again"
            )
        if not BUILD_SCRIPT.is_file():
            raise DevclusterError(f"{BUILD_SCRIPT} is missing; run from a dtjob checkout to build binaries")

    def build_missing(self, log: Path, volcano: bool = False) -> bool:
        """Runs build-binaries.sh (--volcano) when something is missing; returns whether a build ran."""
        missing = self.missing(volcano)
        if not missing:
            return False
        self.check_buildable(volcano)
        log.parent.mkdir(parents=True, exist_ok=True)
        names = ", ".join(p.name for p in missing)
        # A cold Volcano build takes about 10 minutes on 2 cores, Kubernetes' about 13.
        print(f"devcluster: building {names} (minutes when cold; log: {log})", flush=True)
        env = {**os.environ, "DTJOB_CACHE": str(self.cache)}
        argv = ["bash", str(BUILD_SCRIPT), *(["--volcano"] if volcano else [])]
        with log.open("ab") as out:
            result = subprocess.run(argv, stdout=out, stderr=out, env=env, check=False)
        if result.returncode != 0 or self.missing(volcano):
            last = _last_line(log)
            raise DevclusterError(f"building the cluster binaries failed ({last}); full log: {log}")
        return True


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def check_go_buildable(name: str, built: bool, where: Path, script: Path) -> None:
    """A tool built from Go modules (KWOK, Prometheus): refuse early, naming the fix, when it is not
    cached and cannot be built here."""
    if built:
        return
    if shutil.which("go") is None:
        raise DevclusterError(
            f"{name} is not cached in {where} and the Go toolchain is missing; "
            "install Go >= 1.26 (on PATH as `go`) and run again"
        )
    if not script.is_file():
        raise DevclusterError(f"{script} is missing; run from a dtjob checkout to build {name}")


def run_go_build(name: str, script: Path, log: Path, built: Callable[[], bool], how_long: str) -> bool:
    """Run `script` (DTJOB_CACHE set) when `built()` is false, its output appended to `log`;
    returns whether a build ran, raises naming the log's last line when it failed."""
    if built():
        return False
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"devcluster: building {name} ({how_long} when cold; log: {log})", flush=True)
    env = {**os.environ, "DTJOB_CACHE": str(cache_dir())}
    with log.open("ab") as out:
        result = subprocess.run(["bash", str(script)], stdout=out, stderr=out, env=env, check=False)
    if result.returncode != 0 or not built():
        raise DevclusterError(f"building {name} failed ({_last_line(log)}); full log: {log}")
    return True
