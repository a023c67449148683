"""Where `build-binaries.sh --volcano` gets Volcano's release source (its module is not on the Go
module proxy), in this order:

1. the tarball $DTJOB_VOLCANO_TARBALL names;
2. `shared/fixtures/volcano/volcano-<V>-src.tar.gz` beside this checkout, beside the main
   checkout of a git worktree, or beside the repository it was cloned from (`git clone . /tmp/x`,
   as CI does), where such a directory exists;
3. Volcano's upstream release archive on GitHub, downloaded into the cache, when the network
   reaches it.

None of them: the error names all three. Standard library only: build-binaries.sh runs this file
as a script (`python3 volcano_source.py VERSION REPO CACHE`), before any virtual environment
exists, and prints the tarball's path on stdout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV_TARBALL = "DTJOB_VOLCANO_TARBALL"
UPSTREAM_URL = "https://github.com/volcano-sh/volcano/archive/refs/tags/v{version}.tar.gz"
FIXTURE_DIR = Path("shared") / "fixtures" / "volcano"
# A HEAD request to GitHub answers in well under a second where the network allows; 10 s covers a
# slow proxy without making a machine without network wait long for the error.
PROBE_TIMEOUT_SECONDS = 10.0


class VolcanoSourceError(RuntimeError):
    """No source of Volcano's release tarball is available."""


@dataclass(frozen=True)
class VolcanoSource:
    """A local tarball (`path`), or the upstream archive to download (`url`)."""

    path: Path | None = None
    url: str | None = None


def tarball_name(version: str) -> str:
    return f"volcano-{version}-src.tar.gz"


def fixture_candidates(checkouts: Sequence[Path], version: str) -> list[Path]:
    """The fixture's path beside each of `checkouts` (once each, in order)."""
    paths = [checkout.parent / FIXTURE_DIR / tarball_name(version) for checkout in checkouts]
    return list(dict.fromkeys(paths))


def choose(
    version: str,
    env: Mapping[str, str],
    candidates: Sequence[Path],
    is_file: Callable[[Path], bool],
    upstream_reachable: Callable[[str], bool],
) -> VolcanoSource:
    """The first source that is there, in the module's order; VolcanoSourceError naming all three
    when none is. `upstream_reachable` is asked only when no local tarball exists."""
    named = env.get(ENV_TARBALL)
    if named:
        if not is_file(Path(named)):
            raise VolcanoSourceError(f"{ENV_TARBALL}={named} is not a file")
        return VolcanoSource(path=Path(named))
    for candidate in candidates:
        if is_file(candidate):
            return VolcanoSource(path=candidate)
    url = UPSTREAM_URL.format(version=version)
    if upstream_reachable(url):
        return VolcanoSource(url=url)
    looked = ", ".join(str(c) for c in candidates)
    raise VolcanoSourceError(
        f"Volcano {version}'s source is missing: set {ENV_TARBALL} to the path of "
        f"{tarball_name(version)}, or put it in {FIXTURE_DIR}/ beside this checkout (looked at {looked}), "
        f"or allow the network to reach {url}"
    )


def reachable(url: str) -> bool:
    """Whether a HEAD request for `url` succeeds within PROBE_TIMEOUT_SECONDS."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_SECONDS
        ):
            return True
    except OSError:  # URLError, HTTPError and timeouts are OSErrors
        return False


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    ).stdout.strip()


def related_checkouts(repo: Path) -> list[Path]:
    """`repo`, the main checkout when `repo` is a git worktree of it, and the local repository it
    was cloned from (`git clone . /tmp/x`, as CI does), where they exist."""
    found = [repo]
    common = _git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir")
    if common:
        found.append(Path(common).parent)
    origin = _git(repo, "remote", "get-url", "origin")
    if origin and Path(origin).is_dir():
        found.append(Path(origin).resolve())
    return found


def resolve(version: str, repo: Path, cache: Path) -> Path:
    """The local tarball to build from, downloading the upstream archive into `cache` if need be."""
    candidates = fixture_candidates(related_checkouts(repo), version)
    source = choose(version, os.environ, candidates, Path.is_file, reachable)
    if source.path is not None:
        return source.path
    assert source.url is not None
    target = cache / "src" / tarball_name(version)
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        urllib.request.urlretrieve(source.url, partial)
        partial.replace(target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: volcano_source.py VERSION REPO CACHE", file=sys.stderr)
        return 2
    version, repo, cache = argv
    try:
        print(resolve(version, Path(repo), Path(cache)))
    except VolcanoSourceError as error:
        print(f"devcluster: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the download failed half-way
        print(f"devcluster: downloading Volcano {version}'s source failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
