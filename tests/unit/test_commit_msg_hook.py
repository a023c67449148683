""".githooks/commit-msg: a subject of at most 72 characters, a blank line before the body; run as
the hook of a real git repository too."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"


def check(tmp_path: Path, message: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([str(HOOK), str(path)], capture_output=True, text=True, check=False)


def test_a_subject_of_72_characters_passes_and_73_do_not(tmp_path: Path) -> None:
    assert check(tmp_path, "a" * 72 + "\n\nthe body, as long as it likes " * 5 + "\n").returncode == 0
    assert check(tmp_path, "short subject\n").returncode == 0
    refused = check(tmp_path, "a" * 73 + "\n")
    assert refused.returncode == 1
    assert "73 characters, at most 72" in refused.stderr and "body" in refused.stderr


def test_the_body_starts_after_a_blank_line_and_comments_are_skipped(tmp_path: Path) -> None:
    refused = check(tmp_path, "subject\nbody right under it\n")
    assert refused.returncode == 1 and "second line blank" in refused.stderr
    assert (
        check(tmp_path, "# Please enter the commit message\nsubject\n\nbody\n# a comment\n").returncode == 0
    )
    assert check(tmp_path, "# only comments\n").returncode == 1


def test_git_runs_it_as_the_commit_msg_hook(tmp_path: Path) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
        )

    assert git("init", "-q").returncode == 0
    assert git("config", "core.hooksPath", str(HOOK.parent)).returncode == 0
    (tmp_path / "f").write_text("x")
    git("add", "f")
    long = git("commit", "-q", "-m", "s" * 80)
    assert long.returncode != 0 and "80 characters" in long.stderr
    assert git("commit", "-q", "-m", "a short subject", "-m", "the details").returncode == 0
    assert git("log", "--format=%s").stdout.strip() == "a short subject"
