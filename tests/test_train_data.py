"""Token shards in the modded-nanogpt / llm.c format: reading, splitting, header checks, training on them."""

import json
import re

import numpy as np
import pytest
import torch

from spectral_ops.train import data as data_module
from spectral_ops.train import preset, train
from spectral_ops.train.loop import summary_line


def write_shard(path, tokens, *, magic=data_module.SHARD_MAGIC, version=data_module.SHARD_VERSION, count=None):
    """A shard as modded-nanogpt's fineweb.py writes it: 256 int32 of header, then uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as handle:
        handle.write(header.tobytes())
        handle.write(np.asarray(tokens, dtype="<u2").tobytes())
    return path


def tokens(count, seed, vocab=64):
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).numpy()


def test_a_single_shard_validates_on_its_last_five_percent(tmp_path):
    values = tokens(2000, 0)
    corpus = data_module.load_corpus(str(write_shard(tmp_path / "fineweb_train_000001.bin", values)))
    assert (corpus.unit, corpus.vocab_size) == ("token", data_module.GPT2_VOCAB)
    assert np.array_equal(corpus.train, values[:1900]) and np.array_equal(corpus.val, values[1900:])


def test_a_folder_splits_by_name_and_reads_across_shard_boundaries(tmp_path):
    parts = [tokens(300, 1), tokens(200, 2)]
    for index, part in enumerate(parts, 1):
        write_shard(tmp_path / f"fineweb_train_{index:06d}.bin", part)
    write_shard(tmp_path / "fineweb_val_000000.bin", tokens(150, 3))
    corpus = data_module.load_corpus(str(tmp_path), vocab_size=64)
    assert corpus.sizes == (500, 150) and corpus.vocab_size == 64
    joined = np.concatenate(parts)
    assert np.array_equal(corpus.train[290:310], joined[290:310])  # spans the two training shards
    assert np.array_equal(corpus.train[0:500], joined)
    inputs, targets = data_module.train_batch(corpus, step=3, batch_size=8, seq_len=32, seed=0)
    for row, following in zip(inputs.numpy(), targets.numpy()):
        start = next(s for s in range(500 - 32) if np.array_equal(joined[s: s + 32], row))
        assert np.array_equal(joined[start + 1: start + 33], following)


@pytest.mark.parametrize("change, message", [
    (dict(magic=20240521), "magic number 20240521, expected 20240520"),
    (dict(version=2), "version 2, expected 1"),
    (dict(count=101), "the header counts 101 tokens, but the file's 1224 bytes hold 100 after the header"),
])
def test_a_corrupt_header_is_named_with_the_file(tmp_path, change, message):
    path = write_shard(tmp_path / "broken.bin", tokens(100, 4), **change)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        data_module.load_corpus(str(path))


def test_a_truncated_shard_is_named_with_the_file(tmp_path):
    path = tmp_path / "torn.bin"
    path.write_bytes(write_shard(tmp_path / "whole.bin", tokens(100, 5)).read_bytes()[:600])
    with pytest.raises(ValueError, match=re.escape(f"{path}: 600 bytes, too short for the header")):
        data_module.load_corpus(str(path))


def test_folders_without_a_split_or_with_mixed_files_are_refused(tmp_path):
    write_shard(tmp_path / "fineweb_train_000001.bin", tokens(100, 6))
    write_shard(tmp_path / "fineweb_train_000002.bin", tokens(100, 7))
    with pytest.raises(ValueError, match=r"2 token shards, none for validation \('val' in the name\)"):
        data_module.load_corpus(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not a shard")
    with pytest.raises(ValueError, match="mixes .bin token shards with other files .notes.txt"):
        data_module.load_corpus(str(tmp_path))


def test_a_token_past_the_vocabulary_asks_for_a_larger_one(tmp_path):
    shard = write_shard(tmp_path / "train.bin", tokens(400, 8, vocab=300))
    corpus = data_module.load_corpus(str(shard), vocab_size=256)
    with pytest.raises(ValueError, match=r"token id 2[5-9]\d is outside the vocabulary of 256; pass a larger "):
        data_module.train_batch(corpus, step=0, batch_size=4, seq_len=16, seed=0)


def test_training_on_shards_reports_nats_per_token(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder / "fineweb_train_000001.bin", tokens(4000, 9))
    write_shard(folder / "fineweb_val_000000.bin", tokens(1000, 10))
    config = preset("tiny", n_layers=1, d_model=32, n_heads=2, seq_len=16, batch_size=4, steps=2, log_every=2,
                    val_batches=2, data=str(folder), vocab_size=64, out_dir=str(tmp_path / "run"))
    history = train(config, progress=False)
    record = history[-1]
    assert "val_bpb" not in record
    # Uniform random tokens over 64 ids: after 2 steps the model is still near the uniform loss ln 64
    # (nats, not bits: log2 64 = 6 would fail the bound).
    assert abs(record["val_nats_per_token"] - np.log(64)) < 0.5
    assert "nats/token" in summary_line(record)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["val_nats_per_token"] == record["val_nats_per_token"]
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert state["model"]["embed.weight"].shape == (64, 32)


def test_writers_of_the_same_cache_file_at_once_all_succeed(tmp_path):
    """Runs started together build the same cache file at once (the reference and the killed run of
    tests/test_train.py did): every writer succeeds, the file is whole, and no temporary is left.
    Fails on a temporary name shared by all writers (one's rename finds it gone)."""
    import threading

    from spectral_ops.train.data import _write_atomically

    target, content, errors = tmp_path / "train.bin", [b"spectral" * 1000] * 20, []
    barrier = threading.Barrier(4)

    def slow_chunks():
        barrier.wait()  # every writer has opened its temporary before any writes
        for chunk in content:
            yield chunk

    def write():
        try:
            _write_atomically(target, slow_chunks())
        except Exception as error:  # collected: an exception in a thread would not fail the test
            errors.append(error)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert target.read_bytes() == b"".join(content)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.bin"]
