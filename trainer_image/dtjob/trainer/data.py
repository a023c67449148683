"""Byte-level language-modelling data with a global, world-size-independent order.

The corpus is the bytes of a set of text files concatenated in sorted path order (each followed by
a newline). The built-in corpus is the Python standard library's own `.py` sources, found with
`sysconfig` at run time, so every machine with Python has real text to train on (tests and
vendored packages excluded). `--data PATH` takes one file or a directory, read recursively;
files whose first 8 KiB contain a NUL byte are taken for binary and skipped.

A sample is `seq_len + 1` consecutive bytes; the input is the first `seq_len`, the target the last
`seq_len` (the next byte at every position); the vocabulary is the 256 byte values.

Order: the start offsets of the `global_batch_size` samples of global step `s` (1-based) are drawn
from numpy's PCG64 seeded with the pair (seed, s) and nothing else. So step s sees the same samples
whatever the world size, a run resumed at step s needs no position beyond s itself, and data-parallel
rank r of R takes rows [r * B/R, (r + 1) * B/R) of the global batch.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
# Directories of the standard library that are not representative source (huge generated test
# data, a GUI, vendored third-party packages).
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
_BINARY_PROBE_BYTES = 8192


class DataError(Exception):
    """The corpus cannot be read or is too small for the requested sample length."""


def builtin_corpus_files() -> list[Path]:
    """The standard library's `.py` files, in sorted relative-path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        files.extend(Path(dirpath, name) for name in sorted(filenames) if name.endswith(".py"))
    return files


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"--data {path}: no such file or directory")
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            candidate = Path(dirpath, name)
            with candidate.open("rb") as fh:
                if b"\0" not in fh.read(_BINARY_PROBE_BYTES):
                    files.append(candidate)
    return files


@dataclass(frozen=True)
class Corpus:
    """The concatenated bytes and a fingerprint naming exactly this content."""

    tokens: np.ndarray  # uint8, 1-D
    fingerprint: str  # sha256 hex of the bytes
    source: str  # where it came from, for logs
    files: int

    @classmethod
    def load(cls, data: str | None) -> Corpus:
        source = data if data else "python-stdlib:" + sysconfig.get_paths()["stdlib"]
        paths = _text_files(Path(data)) if data else builtin_corpus_files()
        chunks: list[bytes] = []
        for p in paths:
            chunks.append(p.read_bytes())
            chunks.append(b"\n")
        blob = b"".join(chunks)
        if not blob:
            raise DataError(f"--data {source}: no text files found")
        return cls(
            tokens=np.frombuffer(blob, dtype=np.uint8),
            fingerprint=hashlib.sha256(blob).hexdigest(),
            source=source,
            files=len(paths),
        )


class GlobalBatches:
    """The samples of every global step, and each data-parallel rank's slice of them."""

    def __init__(self, corpus: Corpus, seq_len: int, global_batch_size: int, seed: int) -> None:
        if len(corpus.tokens) < seq_len + 2:
            raise DataError(
                f"corpus {corpus.source} has {len(corpus.tokens)} bytes, "
                f"fewer than --seq-len + 2 = {seq_len + 2}"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of `step`; a function of (seed, step) only."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        last_start = len(self.corpus.tokens) - (self.seq_len + 1)
        return rng.integers(0, last_start + 1, size=self.global_batch_size, dtype=np.int64)

    def batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's rows of step `step`, each int64 [B / dp_size, seq_len]."""
        if self.global_batch_size % dp_size != 0:
            raise ValueError(f"global batch {self.global_batch_size} not divisible by {dp_size} replicas")
        per_rank = self.global_batch_size // dp_size
        starts = self.offsets(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        windows = np.stack([self.corpus.tokens[s : s + self.seq_len + 1] for s in starts])
        rows = torch.from_numpy(windows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def position(self, next_step: int) -> dict[str, object]:
        """What a checkpoint records so a resumed run can check it continues the same stream."""
        return {
            "next_step": next_step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "corpus_fingerprint": self.corpus.fingerprint,
            "corpus_source": self.corpus.source,
        }
