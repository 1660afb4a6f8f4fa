"""The reference training loop: presets, data, a short run, resume, sweep and report."""

import dataclasses
import errno
import json
import math
import subprocess
import sys

import pytest
import torch

import spectral_ops.metrics
from spectral_ops.train import PRESETS, Transformer, loop, preset, train
from spectral_ops.train import data as data_module
from spectral_ops.train.__main__ import main
from spectral_ops.train.schedule import lr_multiplier


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_its_model_with_the_formula_parameter_count(name):
    config = preset(name)
    with torch.device("meta"):  # paper12 is 100M parameters: count without allocating them
        model = Transformer(config.model_config())
    assert sum(p.numel() for p in model.parameters()) == config.model_config().parameter_count()


def test_tied_embeddings_drop_the_head():
    config = preset("tiny", tied_embeddings=True).model_config()
    model = Transformer(config)
    assert model.lm_head is None and sum(p.numel() for p in model.parameters()) == config.parameter_count()
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)


def test_schedule_warms_up_then_decays_to_the_floor():
    values = [lr_multiplier(step, 100, 10, 0.1) for step in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(values[9:], values[10:]))


@pytest.fixture
def corpus_dir(tmp_path, monkeypatch):
    """A small generated corpus of 40 files, and a private token cache."""
    monkeypatch.setattr(data_module, "DEFAULT_CACHE", tmp_path / "cache")
    folder = tmp_path / "corpus"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "spectral", "decay", "matrix", "power"]
    for i in range(40):
        picks = torch.randint(0, len(words), (400,), generator=generator).tolist()
        (folder / f"file{i:02d}.txt").write_text(" ".join(words[j] for j in picks) + "\n")
    return folder


def tiny_run(tmp_path, corpus_dir, **overrides):
    options = dict(n_layers=1, d_model=32, n_heads=2, seq_len=32, batch_size=4, steps=6, warmup_steps=2,
                   log_every=1, val_batches=2, data=str(corpus_dir), out_dir=str(tmp_path / "run"),
                   p=2, spectral_weight_decay=0.1, lr=1e-2)
    options.update(overrides)
    return preset("tiny", **options)


def test_data_split_is_by_file_and_deterministic(corpus_dir):
    corpus = data_module.load_corpus(str(corpus_dir))
    files = sorted(corpus_dir.iterdir())
    validation_files = [p for p, v in zip(files, data_module.validation_flags([p.name for p in files])) if v]
    assert 0 < len(validation_files) < 40
    assert len(corpus.val) == sum(p.stat().st_size for p in validation_files)
    first, second = (data_module.train_batch(corpus, 7, 4, 16, seed=1) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[0][:, 1:], first[1][:, :-1])


def test_default_corpus_is_the_standard_library():
    root, files = data_module.stdlib_files()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert files == sorted(files)


def test_a_short_run_lowers_the_loss_on_a_fixed_batch_and_writes_its_logs(tmp_path, corpus_dir):
    config = tiny_run(tmp_path, corpus_dir, steps=20, log_every=10)
    corpus = data_module.load_corpus(config.data)
    batch = data_module.validation_batches(corpus, 1, 4, config.seq_len)[0]

    def loss_of(model):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten()).item()

    torch.manual_seed(config.seed)
    before = loss_of(Transformer(config.model_config()))
    history = train(config, progress=False)
    state = torch.load(tmp_path / "run" / loop.CHECKPOINT, weights_only=False)
    trained = Transformer(config.model_config())
    trained.load_state_dict(state["model"])
    assert loss_of(trained) < before
    assert [r["step"] for r in history] == [10, 20]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["val_bpb"] == history[-1]["val_bpb"]
    assert (tmp_path / "run" / "metrics.csv").read_text().startswith("step,train_loss")
    for key in ("mlp_gate/stable_rank", "mlp_down/stable_rank", "qk/stable_rank", "attention/entropy",
                "v/cross_head_cka", "o/effective_lr"):
        assert torch.isfinite(torch.tensor(history[-1][key]))


def test_resume_gives_identical_losses(tmp_path, corpus_dir, monkeypatch):
    reference = train(tiny_run(tmp_path / "a", corpus_dir, checkpoint_every=3), progress=False)

    interrupted = tiny_run(tmp_path / "b", corpus_dir, checkpoint_every=3)
    real_save = loop.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted, progress=False)
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed = train(interrupted, resume=True, progress=False)
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in reference]
    assert [r["val_bpb"] for r in resumed] == [r["val_bpb"] for r in reference]


def test_metric_logging_uses_the_metrics_module(tmp_path, corpus_dir, monkeypatch):
    calls = []
    original = spectral_ops.metrics.matrix_metrics

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(spectral_ops.metrics, "matrix_metrics", counting)
    train(tiny_run(tmp_path, corpus_dir, steps=2, log_every=2), progress=False)
    assert len(calls) == len(loop.monitor.MODULE_TYPES)  # one batched call per module type


@pytest.mark.parametrize("optimizer, extra", [("muon", ["--qkv-recipe", "HHF", "--p-v", "2", "--lambda-v", "0.01"]),
                                              ("sgd", ["--p-attention", "0", "--p-mlp", "2"])])
def test_command_line_train_with_recipes(tmp_path, corpus_dir, optimizer, extra):
    main(["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--batch-size", "2",
          "--steps", "2", "--log-every", "2", "--val-batches", "1", "--data", str(corpus_dir),
          "--optimizer", optimizer, "--out-dir", str(tmp_path / "cli"), *extra])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["optimizer"] == optimizer and (tmp_path / "cli" / "checkpoint.pt").exists()


def test_config_file_then_flags(tmp_path, corpus_dir):
    (tmp_path / "run.json").write_text(json.dumps({"preset": "small", "d_model": 64, "n_heads": 2, "steps": 7}))
    from spectral_ops.train.__main__ import parser
    from spectral_ops.train.config import config_from_arguments

    arguments = ["train", "--config", str(tmp_path / "run.json"), "--steps", "3"]
    config = config_from_arguments(parser().parse_args(arguments))
    assert (config.preset, config.d_model, config.steps, config.n_layers) == (
        "small", 64, 3, PRESETS["small"]["n_layers"])
    (tmp_path / "bad.json").write_text(json.dumps({"depth": 3}))
    with pytest.raises(ValueError, match="unknown config fields"):
        config_from_arguments(parser().parse_args(["train", "--config", str(tmp_path / "bad.json")]))


def test_sweep_and_report_produce_their_files(tmp_path, corpus_dir):
    common = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--batch-size", "2",
              "--steps", "2", "--log-every", "2", "--val-batches", "1", "--data", str(corpus_dir)]
    main(["sweep", *common, "--powers", "1", "2", "--coefficients", "0.05", "--out", str(tmp_path / "sweep")])
    rows = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [row["p"] for row in rows] == [1, 2]
    assert (tmp_path / "sweep" / "summary.md").read_text().startswith("| run |")
    main(["report", str(tmp_path / "sweep" / "p1_lam0.05"), str(tmp_path / "sweep" / "p2_lam0.05"),
          "--out", str(tmp_path / "report")])
    for name in ("spectra.png", "spectra.md", "spectra.json", "histograms.png", "validation.png",
                 "coefficients.png", "pure_decay.png", "pure_decay.md"):
        assert (tmp_path / "report" / name).stat().st_size > 0


def test_demo_command_runs_on_the_standard_library(tmp_path, capsys):
    main(["demo", "--steps", "2", "--out", str(tmp_path / "demo")])
    printed = capsys.readouterr().out
    assert "| p1_lam0.3 | 1 |" in printed and "| p4_lam0.3 | 4 |" in printed
    assert (tmp_path / "demo" / "report" / "spectra.png").exists()


def test_muon_orthogonalises_in_fp32_on_a_cpu_unless_told_otherwise():
    # bf16 matmuls on a CPU without native bf16 are ~100x slower than fp32: the loop's default there.
    from spectral_ops.train.optimizers import build_optimizer

    config = preset("tiny", optimizer="muon")
    model = Transformer(config.model_config())
    precisions = {group["precision"] for group in build_optimizer(model, config).param_groups
                  if group["algorithm"] == "muon"}
    assert precisions == {"fp32"}
    config = preset("tiny", optimizer="muon", muon_precision="bf16")
    precisions = {group["precision"] for group in build_optimizer(model, config).param_groups
                  if group["algorithm"] == "muon"}
    assert precisions == {"bf16"}


def test_every_flag_of_every_command_has_a_help_line():
    import argparse

    from spectral_ops.train.__main__ import parser

    def actions(p):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from actions(sub)
            else:
                yield action

    missing = [a.option_strings or a.dest for a in actions(parser()) if not a.help]
    assert not missing, missing


def test_checkpoints_rotate_and_resume_falls_back_past_a_corrupt_one(tmp_path, corpus_dir):
    reference = train(tiny_run(tmp_path / "a", corpus_dir, checkpoint_every=2), progress=False)
    config = tiny_run(tmp_path / "b", corpus_dir, checkpoint_every=2)
    train(config, progress=False)
    out = tmp_path / "b" / "run"
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint.1.pt", "checkpoint.pt"]
    (out / "checkpoint.pt").write_bytes(b"torn")  # the newest (step 6) is corrupt: resume from step 4
    with pytest.warns(RuntimeWarning, match=r"cannot resume from .*checkpoint\.pt"):
        resumed = train(config, resume=True, progress=False)
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in reference]
    assert [r["val_bpb"] for r in resumed] == [r["val_bpb"] for r in reference]


def test_resume_refuses_a_changed_config_and_says_when_there_is_nothing(tmp_path, corpus_dir, capsys):
    config = tiny_run(tmp_path, corpus_dir, steps=2)
    train(config, resume=True, progress=False)
    assert "nothing to resume" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"config differs .*p: 2 -> 3.*--force"):
        train(dataclasses.replace(config, p=3), resume=True, progress=False)


def test_a_diverging_run_stops_without_checkpointing_non_finite_weights(tmp_path, corpus_dir):
    config = tiny_run(tmp_path, corpus_dir, steps=6, checkpoint_every=1, lr=1e6, grad_clip=0.0)
    with pytest.raises(FloatingPointError,
                       match="not finite|non-finite gradients|training loss is nan|training loss is inf"):
        train(config, progress=False)
    for path in tmp_path.glob("run/checkpoint*.pt"):
        state = torch.load(path, weights_only=False)
        assert all(torch.isfinite(v).all() for v in state["model"].values()), path


def test_cli_killed_with_sigkill_resumes_past_a_corrupt_newest_checkpoint_bitwise(tmp_path, corpus_dir):
    """The real failure, not a simulated one: the CLI as a subprocess, SIGKILLed wherever it happens
    to be (possibly inside a checkpoint or log write), its newest checkpoint then corrupted; --resume
    must name the corrupt file, start from the one before, and log what an uninterrupted run logs."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    steps = 60  # ~2.5 s of training at ~25 steps/s: 50 steps after the kill point, far longer than a poll
    flags = ["train", "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--seq-len", "32",
             "--batch-size", "4", "--steps", str(steps), "--warmup-steps", "2", "--log-every", "1",
             "--val-batches", "2", "--data", str(corpus_dir), "--p", "2", "--spectral-weight-decay", "0.1",
             "--lr", "1e-2", "--checkpoint-every", "3", "--keep-checkpoints", "3"]
    # The fixture's private token cache reaches a subprocess only through the environment, and so
    # does the checkout under test (an editable install elsewhere would otherwise win). One thread in
    # every run: the same reduction order in all three, and no OpenMP thread spinning at a barrier
    # for a core that a loaded machine (other test processes, the other run) has given away, which
    # made a 7 s run take minutes.
    package_root = str(Path(spectral_ops.__file__).resolve().parents[1])
    env = {**os.environ, "SPECTRAL_OPS_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    timeout = 300  # a healthy run takes ~7 s; only a hung one gets near this
    started = []

    def start(out, *extra):
        # stderr to a file, not a pipe: nobody reads a pipe until the end.
        log = open(tmp_path / f"{out}.{len(extra)}.stderr", "w+")
        command = [sys.executable, "-m", "spectral_ops.train", *flags, "--out-dir", str(tmp_path / out), *extra]
        started.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env))
        return started[-1], log

    def finish(process, log):
        assert process.wait(timeout=timeout) == 0, log.seek(0) or log.read()[-3000:]
        log.seek(0)
        return log.read()

    try:
        reference, reference_log = start("reference")  # runs alongside the killed run: the test's wall time
        victim, victim_log = start("victim")
        out = tmp_path / "victim"
        paths = loop.checkpoint_paths(out, 3)
        # Once the third checkpoint exists, every instant of a later rotation (shift .1 -> .2, .pt -> .1,
        # then .tmp -> .pt) leaves at least two complete checkpoints, so one corrupted still leaves one.
        deadline = time.monotonic() + timeout
        while not paths[-1].exists():
            assert victim.poll() is None, victim_log.seek(0) or victim_log.read()[-3000:]
            assert time.monotonic() < deadline, f"no third checkpoint within {timeout} s"
            time.sleep(0.005)
        assert victim.poll() is None, f"the run finished before the kill; make it longer than {steps} steps"
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=timeout) == -signal.SIGKILL

        found = [path for path in paths if path.exists()]
        assert len(found) >= 2, found
        newest, previous = found[0], found[1]
        resume_step = torch.load(previous, weights_only=False)["step"]
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn in the middle

        resumed_log = finish(*start("victim", "--resume"))
        finish(reference, reference_log)
    finally:  # a failed assertion must not leave a run behind, training on
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert f"cannot resume from {newest}" in resumed_log
    # The first progress line shows where the loop started: the previous checkpoint's step, not 0 (from 0
    # the losses would match as well, so they alone would not show that the resume happened).
    assert re.findall(rf": (\d+)/{steps} step", resumed_log)[0] == str(resume_step)

    def records(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    # Bitwise: JSON writes each float's shortest repr, which reads back to the same double. Records up
    # to resume_step come from the checkpoint's history (the killed process), the rest from the resume.
    expected, got = records("reference"), records("victim")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got == expected
    assert (tmp_path / "victim" / "metrics.csv").read_text() == (tmp_path / "reference" / "metrics.csv").read_text()


def test_stability_clamps_are_counted_in_the_logs(tmp_path, corpus_dir, caplog):
    """A coefficient far past the order condition (p kappa >> 1) is clamped at every step of every
    spectrally decayed matrix: the run stays finite, each clamp is logged with its factor, and the
    metrics count them; an ordinary setting clamps nothing."""
    clamped = train(tiny_run(tmp_path / "clamped", corpus_dir, steps=3, p=4, spectral_weight_decay=1e4), progress=False)
    assert 0 < clamped[0]["clamped_updates"] < clamped[-1]["clamped_updates"]
    assert any("reduced the spectral coefficient" in r.getMessage() and "by a factor" in r.getMessage()
               for r in caplog.records if r.name == "spectral_ops.decay")
    assert all(math.isfinite(r["train_loss"]) for r in clamped)
    assert train(tiny_run(tmp_path / "plain", corpus_dir, steps=2), progress=False)[-1]["clamped_updates"] == 0


def test_resume_refuses_another_runs_checkpoint_unless_forced(tmp_path, corpus_dir):
    """A checkpoint of another seed dropped into a run folder, whose config.json is this run's: whole, so
    not passed over as corrupt, but refused by the config it embeds, before anything in the folder changes."""
    config = tiny_run(tmp_path / "a", corpus_dir, steps=2)
    train(config, progress=False)
    other = train(tiny_run(tmp_path / "b", corpus_dir, steps=2, seed=1), progress=False)
    out = tmp_path / "a" / "run"
    (out / loop.CHECKPOINT).write_bytes((tmp_path / "b" / "run" / loop.CHECKPOINT).read_bytes())
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(ValueError, match=r"differs from .*checkpoint\.pt \(seed: 1 -> 0\); pass --force .*--out-dir"):
        train(config, resume=True, progress=False)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert train(config, resume=True, force=True, progress=False) == other  # taken as it is


def test_resume_refuses_a_checkpoint_without_an_embedded_config_unless_forced(tmp_path, corpus_dir):
    # Every checkpoint the loop ever wrote embeds its config: one without was written or edited elsewhere.
    config = tiny_run(tmp_path, corpus_dir, steps=2)
    history = train(config, progress=False)
    path = tmp_path / "run" / loop.CHECKPOINT
    state = torch.load(path, weights_only=False)
    del state["config"]
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"checkpoint\.pt embeds no config.*--force"):
        train(config, resume=True, progress=False)
    assert train(config, resume=True, force=True, progress=False) == history


def test_a_full_disk_is_named_leaves_no_temporary_file_and_the_run_resumes_bitwise(tmp_path, corpus_dir,
                                                                                    monkeypatch):
    """Once the first checkpoint is in place the disk fills: the temporary becomes a link to /dev/full, on
    which every write fails with ENOSPC from the kernel, as on a full disk. torch.save's own file writer
    said "basic_ios::clear: iostream error" and left the torn temporary."""
    config = tiny_run(tmp_path, corpus_dir, steps=4, checkpoint_every=2)
    reference = train(dataclasses.replace(config, out_dir=str(tmp_path / "reference")), progress=False)
    install = loop.install_checkpoint

    def install_then_fill_the_disk(temporary, paths):
        install(temporary, paths)
        temporary.symlink_to("/dev/full")

    monkeypatch.setattr(loop, "install_checkpoint", install_then_fill_the_disk)
    with pytest.raises(OSError, match=r"No space left on device: writing .*checkpoint\.tmp failed and was "
                                      r"removed.*--resume") as raised:
        train(config, progress=False)
    assert raised.value.errno == errno.ENOSPC
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint.pt"]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 2
    monkeypatch.undo()  # space freed
    assert train(config, resume=True, progress=False) == reference


SHARDED_FULL_DISK = """
import errno, sys
from pathlib import Path
import torch, torch.distributed as dist
from spectral_ops.optim import SpectralAdamW
from spectral_ops.train import loop, preset
out = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=0, world_size=1)
processes = loop.Processes(torch.device("cpu"), mode="ddp")
model = torch.nn.Linear(8, 4)
optimizer = SpectralAdamW(model.parameters(), lr=1e-2)
config = preset("tiny")
loop.save_sharded_checkpoint(out, model, optimizer, 1, [], config, processes)
write = loop.write_aside

def fill_the_disk(temporary, write_state):
    write(temporary, write_state)
    raise OSError(errno.ENOSPC, "No space left on device")

loop.write_aside = fill_the_disk
try:
    loop.save_sharded_checkpoint(out, model, optimizer, 2, [], config, processes)
except OSError as error:
    print("raised", error.errno)
print(sorted(path.name for path in out.iterdir() if "checkpoint" in path.name))
print(torch.load(out / "checkpoint.dcp" / loop.RUN_STATE, weights_only=False)["step"])
dist.destroy_process_group()
"""


def test_a_sharded_save_that_fails_leaves_no_temporary_folder_and_the_previous_checkpoint(tmp_path):
    """--fsdp/--ddp: a part that fails (rank 0's run state on a full disk, simulated after its bytes were
    written) raises on every process, which all learn of it instead of waiting at the next barrier, and rank 0
    removes the temporary folder; the previous checkpoint is whole. One Gloo process, in a child (a process
    group outlives the test otherwise)."""
    result = subprocess.run([sys.executable, "-c", SHARDED_FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [f"raised {errno.ENOSPC}", "['checkpoint.dcp']", "1"]


def test_resume_names_a_field_missing_from_config_json_instead_of_reading_its_default(tmp_path, corpus_dir):
    config = tiny_run(tmp_path, corpus_dir, steps=2)  # lr 1e-2, not the default 3e-3
    history = train(config, progress=False)
    path = tmp_path / "run" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "lr"}))
    with pytest.raises(ValueError, match=r"config\.json \(lr: missing from the saved config \(its default is "
                                         r"0\.003\) -> 0\.01\)"):
        train(config, resume=True, progress=False)
    assert train(config, resume=True, force=True, progress=False) == history


def test_resume_names_an_unreadable_config_json_and_its_fixes(tmp_path, corpus_dir):
    config = tiny_run(tmp_path, corpus_dir, steps=2)
    history = train(config, progress=False)
    path = tmp_path / "run" / "config.json"
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])  # torn
    fixes = r"config\.json is unreadable \(JSONDecodeError.*restore it.*delete it.*--force"
    with pytest.raises(ValueError, match=fixes):
        train(config, resume=True, progress=False)
    assert train(config, resume=True, force=True, progress=False) == history
    assert path.read_text() == whole  # rewritten
    path.unlink()  # the other fix: the checkpoint's embedded config is compared instead
    with pytest.raises(ValueError, match=r"checkpoint\.pt \(seed: 0 -> 1\)"):
        train(dataclasses.replace(config, seed=1), resume=True, progress=False)


def test_config_json_is_written_atomically(tmp_path, corpus_dir, monkeypatch):
    """A crash after the new config's bytes are written, before they are on disk under its name, leaves
    the old config.json whole."""
    config = tiny_run(tmp_path, corpus_dir, steps=2)
    train(config, progress=False)
    path = tmp_path / "run" / "config.json"
    old = path.read_bytes()

    def crash(descriptor):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        train(dataclasses.replace(config, lr=2e-2), progress=False)
    assert path.read_bytes() == old


def test_a_moved_run_folder_resumes_with_other_run_keeping_fields_to_the_same_numbers(tmp_path, corpus_dir):
    """Where a run lives and how it is logged, checkpointed and guarded (RUN_KEEPING_FIELDS) changes no
    number: a run folder moved elsewhere resumes, with every such field changed, without --force, and logs
    what the uninterrupted run logs bitwise at the steps both log."""
    from spectral_ops.train.config import RUN_KEEPING_FIELDS

    reference = train(tiny_run(tmp_path / "a", corpus_dir, checkpoint_every=3), progress=False)
    train(tiny_run(tmp_path / "b", corpus_dir, checkpoint_every=3), progress=False)
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    (tmp_path / "b" / "run").rename(moved)
    (moved / loop.CHECKPOINT).unlink()  # resume from the step-3 checkpoint, so that steps 4-6 are run again
    kept = dict(out_dir=str(moved), log_every=2, checkpoint_every=1, keep_checkpoints=3, max_skipped_steps=1,
                allow_stand_in_data=True)
    assert set(kept) == RUN_KEEPING_FIELDS
    resumed = train(tiny_run(tmp_path / "b", corpus_dir, **kept), resume=True, progress=False)
    # The checkpoint's history logs every step up to 3, the resumed run steps 4 and 6.
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 6]
    by_step = {r["step"]: r for r in reference}
    assert resumed == [by_step[r["step"]] for r in resumed]


def test_qk_clip_clips_after_every_step_and_is_refused_before_anything_is_written(tmp_path, corpus_dir, monkeypatch):
    from spectral_ops.train.qk_clip import QKClip

    factors = []
    step = QKClip.step
    monkeypatch.setattr(QKClip, "step", lambda self, *args: factors.append(step(self, *args)) or factors[-1])
    train(tiny_run(tmp_path, corpus_dir, qk_clip=1e-3, steps=3), progress=False)
    # once per step, on that step's own forward (the validations' eval forwards are not observed), and a
    # threshold below every logit clips every head
    assert len(factors) == 3 and all((f < 1).all() for f in factors)
    with pytest.raises(ValueError, match="positive finite logit"):
        train(tiny_run(tmp_path, corpus_dir, qk_clip=-1.0, out_dir=str(tmp_path / "refused")), progress=False)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match="runs on one process"):
        loop.parallel_mode(tiny_run(tmp_path, corpus_dir, qk_clip=100.0, ddp=True))
