"""Where Volcano's release source comes from: the order of the three sources, and the error."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dtjob.devcluster import volcano_source as vs

VERSION = "1.15.1"
BESIDE = [Path("/a/shared/fixtures/volcano/volcano-1.15.1-src.tar.gz"), Path("/b/shared/fixtures/x.tar.gz")]
URL = "https://github.com/volcano-sh/volcano/archive/refs/tags/v1.15.1.tar.gz"


def _choose(
    env: dict[str, str], files: set[Path], online: bool, asked: list[str] | None = None
) -> vs.VolcanoSource:
    def reachable(url: str) -> bool:
        if asked is not None:
            asked.append(url)
        return online

    return vs.choose(VERSION, env, BESIDE, lambda p: p in files, reachable)


def test_the_environment_variable_comes_first() -> None:
    env = {vs.ENV_TARBALL: "/mine.tar.gz"}
    assert _choose(env, {Path("/mine.tar.gz"), *BESIDE}, True) == vs.VolcanoSource(path=Path("/mine.tar.gz"))


def test_a_named_tarball_that_is_missing_is_an_error_not_a_fallback() -> None:
    with pytest.raises(vs.VolcanoSourceError, match=r"DTJOB_VOLCANO_TARBALL=/gone\.tar\.gz is not a file"):
        _choose({vs.ENV_TARBALL: "/gone.tar.gz"}, set(BESIDE), True)


def test_then_the_fixtures_in_order_without_asking_the_network() -> None:
    asked: list[str] = []
    assert _choose({}, set(BESIDE), True, asked) == vs.VolcanoSource(path=BESIDE[0])
    assert _choose({}, {BESIDE[1]}, True, asked) == vs.VolcanoSource(path=BESIDE[1])
    assert asked == []


def test_then_upstream_when_reachable() -> None:
    asked: list[str] = []
    assert _choose({}, set(), True, asked) == vs.VolcanoSource(url=URL)
    assert asked == [URL]


def test_none_names_all_three() -> None:
    with pytest.raises(vs.VolcanoSourceError) as error:
        _choose({vs.ENV_TARBALL: ""}, set(), False)
    message = str(error.value)
    assert vs.ENV_TARBALL in message
    assert all(str(path) in message for path in BESIDE)
    assert URL in message


def test_fixture_candidates_beside_each_checkout_once() -> None:
    found = vs.fixture_candidates([Path("/w/wt/docs"), Path("/w/main"), Path("/w/main")], VERSION)
    assert found == [
        Path("/w/wt/shared/fixtures/volcano/volcano-1.15.1-src.tar.gz"),
        Path("/w/shared/fixtures/volcano/volcano-1.15.1-src.tar.gz"),
    ]


def test_related_checkouts_of_a_clone(tmp_path: Path) -> None:
    """A clone of a local repository finds the fixtures beside the repository it came from."""
    origin, clone = tmp_path / "origin", tmp_path / "elsewhere" / "clone"
    subprocess.run(["git", "init", "-q", str(origin)], check=True)
    subprocess.run(
        ["git", "-C", str(origin), "commit", "-q", "--allow-empty", "-m", "x"],
        check=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
            "PATH": "/usr/bin:/bin",
        },
    )
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    assert vs.related_checkouts(clone) == [clone, clone, origin.resolve()]


def test_the_script_prints_the_error_and_fails(tmp_path: Path) -> None:
    """build-binaries.sh runs the file as a script (no package on the path): it must stand alone."""
    script = Path(vs.__file__)
    env = {"PATH": "/usr/bin:/bin", vs.ENV_TARBALL: str(tmp_path / "none.tar.gz")}
    done = subprocess.run(
        ["python3", str(script), VERSION, str(tmp_path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert f"{vs.ENV_TARBALL}={tmp_path / 'none.tar.gz'} is not a file" in done.stderr
    tarball = tmp_path / "v.tar.gz"
    tarball.write_bytes(b"")
    env[vs.ENV_TARBALL] = str(tarball)
    done = subprocess.run(
        ["python3", str(script), VERSION, str(tmp_path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, str(tarball))
