"""Byte-level data: a real corpus that is always there offline, tokenised once into memory maps.

The default corpus is the running interpreter's standard library source (``*.py`` under
``sysconfig``'s stdlib path, ``site-packages`` excluded), a sorted file list split into train and
validation by a hash of each file's relative path, so the split never depends on the file order.
``--data PATH`` takes a text file (the last 5% of its bytes validate) or a folder (all files,
split by file like the default). Tokens are bytes (vocabulary 256), cached as ``train.bin`` and
``val.bin`` under a key of the file list and sizes, and read back with ``numpy.memmap``.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VALIDATION_SHARE = 20  # one file in 20 (by hash) validates
SINGLE_FILE_VALIDATION = 0.05
DEFAULT_CACHE = Path(os.environ.get("SPECTRAL_OPS_CACHE", Path.home() / ".cache" / "spectral_ops")) / "corpora"


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return root, files


def folder_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _file_hash(relative_path: str) -> int:
    return zlib.crc32(relative_path.encode())


def validation_flags(relative_paths: list[str]) -> list[bool]:
    """One file in ``VALIDATION_SHARE`` validates, chosen by a hash of its path; a small folder
    whose hashes pick none still gets one validation file (the one with the smallest hash)."""
    flags = [_file_hash(path) % VALIDATION_SHARE == 0 for path in relative_paths]
    if not any(flags):
        flags[min(range(len(relative_paths)), key=lambda i: _file_hash(relative_paths[i]))] = True
    return flags


@dataclass
class Corpus:
    """Memory-mapped train and validation byte streams."""

    train: np.ndarray
    val: np.ndarray
    description: str

    @property
    def sizes(self) -> tuple[int, int]:
        return len(self.train), len(self.val)


def _cache_key(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha1(str(root).encode())
    for path in files:
        digest.update(f"{path.relative_to(root)}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def _write_atomically(path: Path, chunks) -> None:
    temporary = path.with_suffix(".tmp")
    with open(temporary, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
    os.replace(temporary, path)


def load_corpus(data: str | None = None, cache_dir: Path = DEFAULT_CACHE) -> Corpus:
    """The corpus for ``--data`` (None: the standard library), tokenised on first use."""
    if data is None:
        root, files = stdlib_files()
        description = f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)"
    else:
        path = Path(data).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"--data {data}: no such file or folder")
        root, files = (path.parent, [path]) if path.is_file() else (path, folder_files(path))
        if not files:
            raise ValueError(f"--data {data}: the folder holds no files")
        description = f"{path} ({len(files)} files)"
    directory = Path(cache_dir) / _cache_key(root, files)
    train_path, val_path = directory / "train.bin", directory / "val.bin"
    if not (train_path.exists() and val_path.exists()):
        directory.mkdir(parents=True, exist_ok=True)
        if len(files) == 1:
            text = files[0].read_bytes()
            cut = int(len(text) * (1 - SINGLE_FILE_VALIDATION))
            _write_atomically(train_path, [text[:cut]])
            _write_atomically(val_path, [text[cut:]])
        else:
            validation = validation_flags([str(p.relative_to(root)) for p in files])
            _write_atomically(train_path, (p.read_bytes() for p, v in zip(files, validation) if not v))
            _write_atomically(val_path, (p.read_bytes() for p, v in zip(files, validation) if v))
    train, val = (np.memmap(p, dtype=np.uint8, mode="r") for p in (train_path, val_path))
    return Corpus(train=train, val=val, description=description)


def _windows(tokens: np.ndarray, starts: torch.Tensor, seq_len: int):
    rows = np.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


def train_batch(corpus: Corpus, step: int, batch_size: int, seq_len: int, seed: int):
    """The batch of ``step``: a function of (seed, step) alone, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    high = len(corpus.train) - seq_len - 1
    if high <= 0:
        raise ValueError(f"the training text ({len(corpus.train)} bytes) is shorter than one sequence ({seq_len + 1})")
    return _windows(corpus.train, torch.randint(0, high, (batch_size,), generator=generator), seq_len)


def validation_batches(corpus: Corpus, batches: int, batch_size: int, seq_len: int):
    """Fixed, evenly spaced validation windows (the same for every run on the corpus)."""
    high = len(corpus.val) - seq_len - 1
    if high <= 0:
        raise ValueError(f"the validation text ({len(corpus.val)} bytes) is shorter than one sequence ({seq_len + 1})")
    starts = torch.linspace(0, high, batches * batch_size).long()
    return [_windows(corpus.val, chunk, seq_len) for chunk in starts.split(batch_size)]
