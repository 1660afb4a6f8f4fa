"""Training data: bytes of a real corpus that is always there offline, or pre-tokenised shards.

The default corpus is the running interpreter's standard library source (``*.py`` under
``sysconfig``'s stdlib path, ``site-packages`` excluded), a sorted file list split into train and
validation by a hash of each file's relative path, so the split never depends on the file order.
``--data PATH`` takes a text file (the last 5% of its bytes validate) or a folder (all files,
split by file like the default). Tokens are bytes (vocabulary 256), cached as ``train.bin`` and
``val.bin`` under a key of the file list and sizes, and read back with ``numpy.memmap``.

``--data`` also takes token shards in the modded-nanogpt / llm.c format (``fineweb_train_*.bin``):
a header of 256 little-endian int32 (magic 20240520, version 1, token count), then the uint16
tokens. A ``.bin`` file (the last 5% of its tokens validate) or a folder of them, where shards with
``val`` in their name validate. They are read in place with ``numpy.memmap``; the header holds no
vocabulary size, so it comes from ``--vocab-size`` (default: GPT-2's 50257).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import environment

BYTE_VOCAB = 256
GPT2_VOCAB = 50257  # the token shards' default vocabulary: GPT-2's BPE, which FineWeb's shards use
SHARD_MAGIC = 20240520
SHARD_VERSION = 1  # uint16 tokens (llm.c's version 2 holds uint32 Llama-3 tokens)
SHARD_HEADER_BYTES = 256 * 4
VALIDATION_SHARE = 20  # one file in 20 (by hash) validates
SINGLE_FILE_VALIDATION = 0.05
DEFAULT_CACHE = environment.cache_dir() / "corpora"


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


class ConcatenatedTokens:
    """Several memory-mapped shards read as one stream. A window may span two shards: FineWeb's
    shards are cut mid-document anyway, and every document starts with an end-of-text token."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(shard) for shard in shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        pieces = []
        index = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.offsets[index + 1]))
            pieces.append(self.shards[index][start - self.offsets[index]: end - self.offsets[index]])
            start, index = end, index + 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


@dataclass
class Corpus:
    """Memory-mapped train and validation token streams; ``unit`` says what a token is: ``"byte"``
    (validation in bits per byte) or ``"token"`` (a tokeniser's, validation in nats per token)."""

    train: np.ndarray | ConcatenatedTokens
    val: np.ndarray | ConcatenatedTokens
    description: str
    vocab_size: int = BYTE_VOCAB
    unit: str = "byte"

    @property
    def sizes(self) -> tuple[int, int]:
        return len(self.train), len(self.val)


def _cache_key(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha1(str(root).encode())
    for path in files:
        digest.update(f"{path.relative_to(root)}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def _write_atomically(path: Path, chunks) -> None:
    """Write ``path`` whole or not at all. The temporary is this writer's own: runs started together (a
    sweep, the processes of a launch) build the same cache file at once, and a shared temporary name
    made one writer's rename fail once another had renamed it, or mixed their bytes."""
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp", delete=False)
    try:
        with handle:
            for chunk in chunks:
                handle.write(chunk)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def read_shard(path: Path) -> np.ndarray:
    """The tokens of one modded-nanogpt / llm.c shard, memory-mapped after its header is checked."""
    size = path.stat().st_size
    layout = (f"a token shard is {SHARD_HEADER_BYTES} bytes of header (256 int32: magic {SHARD_MAGIC}, version "
              f"{SHARD_VERSION}, token count), then the uint16 tokens")
    if size < SHARD_HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, too short for the header ({layout})")
    magic, version, count = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        raise ValueError(f"{path}: magic number {magic}, expected {SHARD_MAGIC} ({layout})")
    if version != SHARD_VERSION:
        raise ValueError(f"{path}: version {version}, expected {SHARD_VERSION} (uint16 tokens; {layout})")
    if count <= 0 or size != SHARD_HEADER_BYTES + 2 * count:
        raise ValueError(f"{path}: the header counts {count} tokens, but the file's {size} bytes hold "
                         f"{(size - SHARD_HEADER_BYTES) / 2:g} after the header ({layout})")
    return np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER_BYTES, shape=(count,))


def token_shards(path: Path) -> list[Path]:
    """The ``.bin`` shards ``--data`` names (empty: it names text, read as bytes)."""
    if path.is_file():
        return [path] if path.suffix == ".bin" else []
    files = folder_files(path)
    shards = [p for p in files if p.suffix == ".bin"]
    if shards and len(shards) != len(files):
        others = [str(p.relative_to(path)) for p in files if p.suffix != ".bin"]
        raise ValueError(f"--data {path}: the folder mixes .bin token shards with other files ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}); point --data at shards only or at text only")
    return shards


def load_token_shards(path: Path, shards: list[Path], vocab_size: int) -> Corpus:
    """Shards with ``val`` in their name validate; a single shard validates on its last 5%."""
    validation = [p for p in shards if "val" in p.name]
    training = [p for p in shards if "val" not in p.name]
    vocab_size = vocab_size or GPT2_VOCAB
    if len(shards) == 1 and training:
        tokens = read_shard(shards[0])
        cut = int(len(tokens) * (1 - SINGLE_FILE_VALIDATION))
        return Corpus(train=tokens[:cut], val=tokens[cut:], vocab_size=vocab_size, unit="token",
                      description=f"{path} (one token shard, last {SINGLE_FILE_VALIDATION:.0%} validates)")
    if not training or not validation:
        missing = "training (no 'val' in the name)" if not training else "validation ('val' in the name)"
        raise ValueError(f"--data {path}: {len(shards)} token shards, none for {missing}")

    def stream(paths):
        arrays = [read_shard(p) for p in paths]
        return arrays[0] if len(arrays) == 1 else ConcatenatedTokens(arrays)

    return Corpus(train=stream(training), val=stream(validation), vocab_size=vocab_size, unit="token",
                  description=f"{path} ({len(training)} training and {len(validation)} validation token shards)")


def load_corpus(data: str | None = None, cache_dir: Path = DEFAULT_CACHE, vocab_size: int = 0) -> Corpus:
    """The corpus for ``--data`` (None: the standard library): bytes, tokenised on first use, or
    token shards. ``vocab_size`` 0: 256 for bytes, GPT-2's 50257 for shards."""
    if data is not None:
        path = Path(data).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"--data {data}: no such file or folder")
        shards = token_shards(path)
        if shards:
            return load_token_shards(path, shards, vocab_size)
    if vocab_size and vocab_size < BYTE_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size}: bytes need a vocabulary of at least {BYTE_VOCAB}")
    if data is None:
        root, files = stdlib_files()
        description = f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)"
    else:
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
    return Corpus(train=train, val=val, description=description, vocab_size=vocab_size or BYTE_VOCAB)


def _windows(corpus: Corpus, tokens, starts: torch.Tensor, seq_len: int):
    rows = np.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    # An id past the vocabulary would index the embedding out of range (a device-side assert on a GPU).
    if rows.max() >= corpus.vocab_size:
        raise ValueError(f"{corpus.description}: token id {rows.max()} is outside the vocabulary of "
                         f"{corpus.vocab_size}; pass a larger --vocab-size")
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


def train_batch(corpus: Corpus, step: int, batch_size: int, seq_len: int, seed: int):
    """The batch of ``step``: a function of (seed, step) alone, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    high = len(corpus.train) - seq_len - 1
    if high <= 0:
        raise ValueError(f"the training text ({len(corpus.train)} {corpus.unit}s) is shorter than one sequence "
                         f"({seq_len + 1})")
    return _windows(corpus, corpus.train, torch.randint(0, high, (batch_size,), generator=generator), seq_len)


def validation_batches(corpus: Corpus, batches: int, batch_size: int, seq_len: int):
    """Fixed, evenly spaced validation windows (the same for every run on the corpus)."""
    high = len(corpus.val) - seq_len - 1
    if high <= 0:
        raise ValueError(f"the validation text ({len(corpus.val)} {corpus.unit}s) is shorter than one sequence "
                         f"({seq_len + 1})")
    wanted = batches * batch_size * seq_len
    if wanted > len(corpus.val):
        warnings.warn(f"validation asks for {wanted} {corpus.unit}s but {corpus.description} holds {len(corpus.val)} "
                      "for validation: its windows overlap", RuntimeWarning, stacklevel=2)
    starts = torch.linspace(0, high, batches * batch_size).long()
    return [_windows(corpus, corpus.val, chunk, seq_len) for chunk in starts.split(batch_size)]
