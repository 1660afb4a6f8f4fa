"""bench/monitor_cost.py on small shapes: the report's structure, and its FLOP counts, which are the same on
every machine, against a count by hand from the shapes. No timing bound: times are this machine's."""

from __future__ import annotations

import json
import math

import monitor_cost

# One layer of width 32 with 2 heads, a 2 x 16 batch: seconds in all, and every kind of matrix of a preset.
SHAPES = {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16, "batch_size": 2}
TIMING_KEYS = {"threads", "step_s", "compute_s", "first_call_s", "exact_s", "ratio", "first_call_over_step",
               "exact_ratio", "within_goal"}


def by_hand(config: dict, vocab: int, hidden: int, every: int, iterations: int, first_iterations: int) -> dict:
    """The products of a step and of a monitor call, counted from the shapes.

    Step: every linear layer (4 d^2 attention, 3 d h MLP per layer, the d x V head) costs 2 flops per weight
    and token forward and twice that backward (the weight's and the input's gradient); the fused attention
    4 b s^2 d forward (the scores and their product with V, each head's d_h summing to d) and 10 b s^2 d
    backward (torch's formula: the scores again, then four products). The embedding is a lookup.
    Monitor: each power iteration is two matrix-vector products, 4 m n flops per matrix: every matrix of 2 or
    more dimensions (the embedding too), plus Q and K again, read per head for the logit bound."""
    layers, d, b, s = config["n_layers"], config["d_model"], config["batch_size"], config["seq_len"]
    linear = layers * (4 * d * d + 3 * d * hidden) + d * vocab
    step = 6 * b * s * linear + layers * 14 * b * s * s * d
    matrices = linear + vocab * d + layers * 2 * d * d
    warm, first = 4 * iterations * matrices, 4 * first_iterations * matrices
    return {"step": step, "monitor": warm, "first_call": first, "monitor_over_every_steps": warm / (every * step),
            "first_call_over_step": first / step}


def test_the_report_holds_a_row_per_preset_and_thread_count_and_the_flop_ratio_of_the_shapes(tmp_path):
    every = 50
    argv = ["--presets", "tiny", "small", "--threads", "1", "--rounds", "1", "--warmup", "0", "--every", str(every),
            "--out-md", str(tmp_path / "cost.md"), "--out-json", str(tmp_path / "cost.json")]
    argv += [flag for field, value in SHAPES.items() for flag in ("--set", f"{field}={value}")]
    monitor_cost.main(argv)
    report = json.loads((tmp_path / "cost.json").read_text())
    assert report["command"].startswith("python bench/monitor_cost.py --presets tiny small")
    assert {"cpu", "isa_flags", "threads", "torch"} <= set(report["machine"])
    assert report["settings"]["every"] == every and report["settings"]["overrides"] == SHAPES
    assert [result["preset"] for result in report["presets"]] == ["tiny", "small"]
    table = (tmp_path / "cost.md").read_text().splitlines()
    for result in report["presets"]:
        assert [set(row) for row in result["rows"]] == [TIMING_KEYS]
        row = result["rows"][0]
        assert all(row[key] > 0 and math.isfinite(row[key]) for key in TIMING_KEYS - {"threads", "within_goal"})
        assert row["ratio"] == row["compute_s"] / (every * row["step_s"])
        assert row["within_goal"] == (row["ratio"] <= monitor_cost.GOAL)
        assert sum(line.startswith(f"| {result['preset']} | 1 |") for line in table) == 1  # its timing row
        assert result["config"].items() >= SHAPES.items()
        # 8/3 d rounded up to a multiple of 64 (ModelConfig.hidden), bytes' vocabulary
        expected = by_hand(SHAPES, vocab=256, hidden=128, every=every, iterations=report["settings"]["iterations"],
                           first_iterations=report["settings"]["first_iterations"])
        assert result["flops"] == expected
