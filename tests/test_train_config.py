"""Run configs: the SPEC 7 presets field by field, the validation cadence, the stand-in data guard."""

import dataclasses

import numpy as np
import pytest

from spectral_ops.train import data as data_module
from spectral_ops.train import loop, preset, train
from spectral_ops.train.__main__ import parser
from spectral_ops.train.config import (
    RUN_KEEPING_FIELDS,
    computed_differences,
    config_from_arguments,
    evaluation_steps,
    log_every_for,
    to_dict,
)
from spectral_ops.train.model import Transformer
from spectral_ops.train.optimizers import param_groups

# SPEC 7.5 as written: 12 layers, width 768, head dim 128, sequence 4096, batch 524,288 tokens, 16,204
# steps, peak lr 0.005, 256 warm-up steps, cosine to 0.1x, ordinary WD 0.1 (lr-coupled, SPEC 4's
# full-V recipe), Muon; seed 42, validation on 10.49M tokens 164 times, no gradient clip (issue #19).
SPEC_7_5 = {"n_layers": 12, "d_model": 768, "head_dim": 128, "seq_len": 4096, "step_tokens": 524_288,
            "steps": 16_204, "lr": 0.005, "warmup_steps": 256, "min_lr_ratio": 0.1, "weight_decay": 0.1,
            "convention": "decoupled", "optimizer": "muon", "qkv_recipe": "HHH", "spectral_weight_decay": 0.0,
            "seed": 42, "validation_tokens_millions": 10.49, "validations": 164, "grad_clip": 0.0}
# SPEC 7.4 with SPEC 1.5's base rule: 8 layers, width 512, only lambda_p S_p at the fixed lambda = 0.01,
# scaled by the schedule alone (independent), no ordinary WD; the rest as 7.5.
SPEC_7_4 = {"n_layers": 8, "d_model": 512, "head_dim": 128, "p": 1, "spectral_weight_decay": 0.01,
            "weight_decay": 0.0, "convention": "independent", "optimizer": "muon", "lr": 0.005,
            "warmup_steps": 256, "min_lr_ratio": 0.1, "seed": 42, "grad_clip": 0.0}


def resolved(config) -> dict:
    """The config in the units the SPEC states it."""
    return {**vars(config), "head_dim": config.d_model // config.n_heads,
            "step_tokens": config.batch_size * config.grad_accum * config.seq_len,
            "validation_tokens_millions": round(config.val_batches * config.batch_size * config.seq_len / 1e6, 2),
            "validations": len(evaluation_steps(config.steps, config.log_every))}


@pytest.mark.parametrize("name, spec", [("paper12", SPEC_7_5), ("paper8", SPEC_7_4)])
def test_protocol_presets_are_the_spec_numbers_field_by_field(name, spec):
    values = resolved(preset(name))
    assert {key: values[key] for key in spec} == spec


def test_paper8_groups_carry_only_the_base_rule_on_every_matrix():
    config = preset("paper8", n_layers=1, d_model=32, n_heads=2)  # the groups do not depend on the size
    model = Transformer(config.model_config())
    matrices = [g for g in param_groups(model, config) if g.get("algorithm") != "adamw"]
    assert {g["role"] for g in matrices} == {"q", "k", "v", "o", "mlp_in", "mlp_out"}
    for group in matrices:
        assert (group["p"], group["spectral_weight_decay"], group["weight_decay"], group["convention"]) == \
            (1, 0.01, 0.0, "independent"), group["role"]




def test_cpu_presets_keep_their_settings():
    for name in ("tiny", "small"):
        config = preset(name)
        assert (config.seed, config.grad_clip, config.weight_decay, config.data) == (0, 1.0, 0.0, None)


@pytest.fixture
def stand_in_corpus(monkeypatch):
    """A small byte corpus in place of the standard library's (tokenising that takes seconds)."""
    text = np.frombuffer(b"the default corpus stands in for the protocol's data. " * 200, dtype=np.uint8)
    corpus = data_module.Corpus(train=text, val=text[:2000], description="a stand-in corpus")
    monkeypatch.setattr(loop, "load_corpus", lambda data, vocab_size=0: corpus)


def test_the_loop_validates_at_the_cadence_steps(tmp_path, stand_in_corpus):
    assert evaluation_steps(5, 2) == [2, 4, 5]
    # The last step validates although the cadence does not reach it.
    run = preset("tiny", n_layers=1, d_model=32, n_heads=2, seq_len=16, batch_size=2, steps=5, log_every=2,
                 val_batches=1, out_dir=str(tmp_path / "run"))
    assert [record["step"] for record in train(run, progress=False)] == [2, 4, 5]
    paper12 = evaluation_steps(16_204, log_every_for(16_204, 164))
    assert len(paper12) == 164 and paper12[-1] == 16_204
    with pytest.raises(ValueError, match="exactly 7 times in 10 steps"):
        log_every_for(10, 7)  # cadence 2 validates 5 times, cadence 1 ten times


def small_protocol_run(tmp_path, **overrides):
    return preset("paper8", n_layers=1, d_model=32, n_heads=2, seq_len=16, batch_size=2, steps=1, val_batches=1,
                  log_every=1, out_dir=str(tmp_path / "run"), **overrides)


def test_protocol_presets_refuse_the_default_corpus_unless_allowed(tmp_path, stand_in_corpus):
    with pytest.raises(ValueError, match=r"paper8 follows SPEC 7\.4.*stand-in.*--allow-stand-in-data"):
        train(small_protocol_run(tmp_path), progress=False)
    assert not (tmp_path / "run").exists()  # refused before writing anything
    with pytest.warns(RuntimeWarning, match="do not reproduce the protocol"):
        history = train(small_protocol_run(tmp_path, allow_stand_in_data=True), progress=False)
    assert [r["step"] for r in history] == [1]


def test_a_boolean_flag_alone_means_true():
    args = parser().parse_args(["train", "--preset", "paper12", "--allow-stand-in-data", "--tied-embeddings", "false"])
    config = config_from_arguments(args)
    assert config.allow_stand_in_data is True and config.tied_embeddings is False


def test_a_resume_compares_what_changes_the_numbers_not_where_the_run_lives():
    """One definition for config.json and the checkpoint's config: the run-keeping fields are ignored;
    every other field is compared, those that change only the arithmetic (device: bf16 autocast on a GPU;
    Muon's precision; the parallel layout: the order of sums) included."""
    config = preset("tiny")
    moved = dataclasses.replace(config, out_dir="elsewhere/run", log_every=7, checkpoint_every=5, keep_checkpoints=4,
                                max_skipped_steps=0, allow_stand_in_data=True)
    assert computed_differences(to_dict(config), moved) == {}
    arithmetic = dict(device="cuda", muon_precision="bf16", fsdp=True, tp=2, seed=1, data="other.txt")
    assert computed_differences(to_dict(config), dataclasses.replace(moved, **arithmetic)) == {
        key: (getattr(config, key), value) for key, value in arithmetic.items()}
    assert not RUN_KEEPING_FIELDS & set(arithmetic)
    # A field an older config lacks was added since: that run used its default.
    older = {key: value for key, value in to_dict(config).items() if key != "p_v"}
    assert computed_differences(older, config) == {}
    # A field it lacks where the config is not at the default is named as missing, not read as the default.
    (saved, now), = computed_differences(older, dataclasses.replace(config, p_v=3)).values()
    assert repr(saved) == "missing from the saved config (its default is None)" and now == 3


@pytest.mark.parametrize("text, found", [('{"steps": 3', "JSONDecodeError"), ("[3]", "JSON list")])
def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, text, found):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(ValueError, match=rf"run\.json .*{found}.*correct it"):
        config_from_arguments(parser().parse_args(["train", "--config", str(tmp_path / "run.json")]))
