"""The training loop under ``--fsdp`` and ``--ddp``: torchrun runs of the tiny preset on 2 CPU processes
(Gloo), and under ``--fsdp --tp 2`` on 4, against the single-process run of the same config, resumes from
sharded checkpoints, and the refusals of a run that cannot be distributed as asked."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import spectral_ops
from spectral_ops.train import data as data_module
from spectral_ops.train import preset, train
from spectral_ops.train.config import FLAG_ALIASES

PROCESSES = 2
TP_PROCESSES = 4  # a 2 x 2 mesh: FSDP2 over 2 groups, each splitting the blocks over 2 processes
# A small tiny-preset run that logs every step and checkpoints at its middle. The coefficient is far
# past the stability guard's order condition (p kappa >> 1), so every step clamps it: the clamp counts
# that a sharded checkpoint must carry over are not all zero.
OPTIONS = dict(n_layers=2, d_model=32, n_heads=2, seq_len=32, batch_size=4, steps=8, warmup_steps=2, log_every=1,
               val_batches=2, p=4, spectral_weight_decay=1e4, lr=1e-2, checkpoint_every=4)
# The processes see the single-process run's batches, split by rows, and every other quantity is
# averaged over them: their runs differ from it only in the fp32 rounding of sums taken in another
# order (each process's loss over half the tokens, then the mean of the two; gradients summed per
# half, then averaged by the collective), a few ulp (2^-24 = 6e-8 relative) per step, which the eight
# steps carry forward without amplifying (measured: below 5e-7). Tensor parallelism adds sums of the
# same kind: O's and down's outputs (and the gradients of Q/K/V's and gate/up's inputs) are sums of the
# two processes' halves of their dot products, taken by the collective (measured: below 5e-7 too). A
# real fault (a process training on the other's rows, or on all of them; a gradient summed instead of
# averaged; a metric measured on a shard, or on one process's heads) moves these numbers by 1e-3 or more.
RELATIVE_TOLERANCE = 1e-5
# A healthy launch takes ~15 s on 2 loaded cores (~30 s for the 4 processes of --tp, beside the other
# launches); only a hung one gets near this.
TIMEOUT = 300


def flags(**options) -> list[str]:
    """The command line of ``options``, ``p`` as ``--power`` (the spelling torchrun 2.15 passes through:
    it refuses ``--p`` as an ambiguous abbreviation of its own ``--print-completion``)."""
    return [text for name, value in options.items()
            for text in (FLAG_ALIASES.get(name, ("--" + name.replace("_", "-"),))[0], str(value))]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """The runs' folder and corpus, and ``launch(name, *flags, processes=PROCESSES)``, which starts a torchrun
    of the shrunk tiny run into ``root / name``, and ``finish(launch)``, which waits for it and returns its
    output."""
    root = tmp_path_factory.mktemp("distributed")
    generator = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "spectral", "decay", "matrix", "power"]
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (20_000,), generator=generator)))
    cache = root / "cache"
    # The token cache exists before the runs start: runs building it at the same time would tear it.
    data_module.load_corpus(str(corpus), cache_dir=cache)
    # One thread per process: the launches share 2 cores. The checkout under test, and the private
    # cache, reach the processes through the environment.
    package_root = str(Path(spectral_ops.__file__).resolve().parents[1])
    env = {**os.environ, "SPECTRAL_OPS_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    options = {**OPTIONS, "data": str(corpus)}

    def launch(name, *extra, processes=PROCESSES):
        log = open(root / f"{name}.log", "w+")  # a file, not a pipe: nobody reads a pipe until the end
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   "-m", "spectral_ops.train", "--preset", "tiny", *flags(**options), "--out-dir", str(root / name),
                   *extra]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log

    def finish(launched) -> str:
        process, log = launched
        try:
            code = process.wait(timeout=TIMEOUT)
        finally:  # a failed or hung launch must not stay behind, training on
            if process.poll() is None:
                process.kill()
                process.wait()
        log.seek(0)
        text = log.read()
        # Strictly 0, not judged by the files alone (as process_results judges the optimizer's processes):
        # a user's finished run must exit 0, which is why the loop leaves a Gloo group to the exit.
        assert code == 0, text[-5000:]
        return text

    return SimpleNamespace(root=root, options=options, cache=cache, launch=launch, finish=finish)


def tear_newest_checkpoint(out: Path) -> None:
    """Cut the newest checkpoint's DCP metadata in half, as a crash in the middle of writing it would."""
    metadata = out / "checkpoint.dcp" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])


@pytest.fixture(scope="module")
def tensor_parallel_launch(launcher):
    """The ``--fsdp --tp 2`` run on TP_PROCESSES processes, started before :func:`runs` starts its own
    launches, to run beside them; its own fixture, so that its failure fails its tests alone."""
    launched = launcher.launch("tp", "--fsdp", "--tp", "2", processes=TP_PROCESSES)
    yield launched
    process, _ = launched
    if process.poll() is None:  # :func:`runs` failed before anyone waited for it
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def runs(launcher, tensor_parallel_launch):
    """The single-process run (in this process) and its ``--fsdp`` and ``--ddp`` twins (torchrun, at the
    same time), their logged records; then the ``--fsdp`` run resumed past its torn newest checkpoint,
    in its folder, and the resume's log."""
    root = launcher.root
    launches = [launcher.launch("fsdp", "--fsdp"), launcher.launch("ddp", "--ddp")]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(data_module, "DEFAULT_CACHE", launcher.cache)
            train(preset("tiny", **launcher.options, out_dir=str(root / "single")), progress=False)
    finally:
        for launched in launches:
            launcher.finish(launched)

    logged = {name: records(root / name) for name in ("single", "fsdp", "ddp")}
    tear_newest_checkpoint(root / "fsdp")  # the one after step 8
    resume_log = launcher.finish(launcher.launch("fsdp", "--fsdp", "--resume"))
    return SimpleNamespace(root=root, logged=logged, resume_log=resume_log)


@pytest.fixture(scope="module")
def tensor_parallel_run(launcher, tensor_parallel_launch, runs):
    """The ``--fsdp --tp 2`` run's records; then the run resumed past its torn newest checkpoint, and the
    resume's log."""
    launcher.finish(tensor_parallel_launch)
    out = launcher.root / "tp"
    logged = records(out)
    tear_newest_checkpoint(out)
    resume_log = launcher.finish(launcher.launch("tp", "--fsdp", "--tp", "2", "--resume", processes=TP_PROCESSES))
    return SimpleNamespace(out=out, logged=logged, resume_log=resume_log)


def assert_close(got: list[dict], expected: list[dict]) -> None:
    assert [record.keys() for record in got] == [record.keys() for record in expected]
    for mine, reference in zip(got, expected):
        assert mine == pytest.approx(reference, rel=RELATIVE_TOLERANCE), mine["step"]


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_processes_log_what_the_single_process_run_logs(runs, mode):
    """Losses, validation and every spectral metric (whole weights, also under FSDP), step by step."""
    expected = runs.logged["single"]
    assert [record["step"] for record in expected] == list(range(1, OPTIONS["steps"] + 1))
    assert expected[-1]["clamped_updates"] > expected[0]["clamped_updates"] > 0
    assert_close(runs.logged[mode], expected)


def test_fsdp_with_tensor_parallelism_logs_what_the_single_process_run_logs(runs, tensor_parallel_run):
    """--fsdp --tp 2 on 4 processes: the same numbers, the attention and V metrics joined from both
    halves of the heads."""
    assert_close(tensor_parallel_run.logged, runs.logged["single"])


def test_sharded_checkpoints_are_folders_of_every_process_and_the_run_state(runs):
    """The resumed run's final checkpoint (the folder it resumed from is kept, one below it)."""
    out = runs.root / "fsdp"
    assert sorted(path.name for path in out.glob("checkpoint*")) == ["checkpoint.1.dcp", "checkpoint.dcp"]
    newest = out / "checkpoint.dcp"
    assert sorted(path.name for path in newest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"]
    run_state = torch.load(newest / "run.pt", weights_only=False)
    assert run_state["step"] == OPTIONS["steps"] and run_state["history"] == records(out)
    assert run_state["config"]["fsdp"] and not run_state["config"]["ddp"]
    assert sum(int(count) for count, _ in run_state["clamped"].values()) == records(out)[-1]["clamped_updates"]


def assert_resumed_from_the_older_checkpoint(out: Path, resume_log: str, uninterrupted: list[dict]) -> None:
    """The same processes resume from the step-4 checkpoint: the same reductions in the same order, so
    the logs equal the uninterrupted run's exactly, clamp counts included (they travel in run.pt)."""
    assert f"cannot resume from {out / 'checkpoint.dcp'}" in resume_log
    # The first progress line shows where the loop started: the older checkpoint's step, not 0 (the logs
    # alone would match from 0 as well).
    assert f": {OPTIONS['checkpoint_every']}/{OPTIONS['steps']} step" in resume_log
    assert records(out) == uninterrupted


def test_fsdp_resumes_past_a_torn_checkpoint_to_the_uninterrupted_run_bitwise(runs):
    assert_resumed_from_the_older_checkpoint(runs.root / "fsdp", runs.resume_log, runs.logged["fsdp"])


def test_tensor_parallel_checkpoints_resume_to_the_uninterrupted_run_bitwise(tensor_parallel_run):
    """Every process's shards of the 2-d mesh's parameters and state, saved and loaded by DCP."""
    newest = tensor_parallel_run.out / "checkpoint.dcp"
    assert sorted(path.name for path in newest.glob("*.distcp")) == [f"__{rank}_0.distcp"
                                                                     for rank in range(TP_PROCESSES)]
    assert_resumed_from_the_older_checkpoint(tensor_parallel_run.out, tensor_parallel_run.resume_log,
                                             tensor_parallel_run.logged)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("options, environment, message", [
    ({"fsdp": True}, {}, r"--fsdp trains with one process per GPU, started by torchrun.*torchrun --standalone "
                         r"--nproc-per-node NUMBER_OF_GPUS -m spectral_ops.train --fsdp"),
    ({"ddp": True}, {}, r"torchrun --standalone --nproc-per-node NUMBER_OF_GPUS -m spectral_ops.train --ddp"),
    ({"fsdp": True, "ddp": True}, TORCHRUN, r"--fsdp and --ddp exclude each other"),
    ({"fsdp": True, "batch_size": 5}, TORCHRUN, r"batch_size 5 does not split over 2 processes.*multiple of 2"),
    ({}, TORCHRUN, r"started by torchrun as 2 processes without --fsdp or --ddp"),
    ({"tp": 2}, TORCHRUN, r"--tp 2 splits the blocks of a model that FSDP2 shards.*pass --fsdp with it"),
    ({"fsdp": True, "tp": 3}, TORCHRUN, r"--tp 3: the 4 attention heads do not split over 3.*divides n_heads"),
    ({"fsdp": True, "tp": 4}, TORCHRUN, r"--tp 4 does not divide the 2 processes.*pass a --tp that divides 2"),
    ({"fsdp": True, "tp": 2, "batch_size": 3}, {**TORCHRUN, "WORLD_SIZE": "4"},
     r"batch_size 3 does not split over 2 groups of 2 processes.*multiple of 2"),
])
def test_a_run_that_cannot_be_distributed_as_asked_is_refused_before_it_starts(tmp_path, monkeypatch, options,
                                                                              environment, message):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = dataclasses.replace(preset("tiny", out_dir=str(tmp_path / "run")), **options)
    with pytest.raises((RuntimeError, ValueError), match=message):
        train(config, progress=False)
    assert not (tmp_path / "run").exists()
