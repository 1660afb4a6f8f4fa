"""Progress display: tqdm's bar on a terminal, sparse whole lines anywhere else."""

import io

import pytest

from spectral_ops import progress as progress_module
from spectral_ops.progress import LINE_PERCENT, LINE_SECONDS, progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_one_line_per_few_percent_and_no_carriage_returns():
    log = io.StringIO()
    bar = progress(range(1000), desc="run", unit="step", stream=log)
    for step in bar:
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    # The start, one per LINE_PERCENT of the total, nothing else.
    assert len(lines) == 1 + 100 // LINE_PERCENT
    assert lines[0] == "run: 0/1000 step (0%)"
    assert lines[-1].startswith("run: 1000/1000 step (100%), ") and lines[-1].endswith("loss=0.001")


def test_a_resumed_run_counts_from_where_it_started():
    log = io.StringIO()
    list(progress(range(40, 50), desc="run", total=50, initial=40, stream=log))
    lines = log.getvalue().splitlines()
    assert lines[0] == "run: 40/50 it (80%)" and lines[-1].startswith("run: 50/50 it (100%)")
    assert len(lines) == 1 + (50 - 40) * 100 // 50 // LINE_PERCENT  # the start, then each LINE_PERCENT


def test_without_a_total_a_line_at_most_every_few_seconds(monkeypatch):
    clock = iter(range(0, 10_000, 2))  # each item takes 2 s
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    list(progress(iter(range(100)), desc="sweep", stream=log))
    lines = log.getvalue().splitlines()
    assert lines[0] == "sweep: 0 it" and lines[-1].startswith("sweep: 100 it, ")
    assert len(lines) <= 2 + 200 / LINE_SECONDS


def test_a_short_loop_still_ends_with_its_final_count():
    log = io.StringIO()
    list(progress(range(3), desc="cases", unit="case", stream=log))
    assert log.getvalue().splitlines()[-1].startswith("cases: 3/3 case (100%), ")


def test_a_terminal_gets_tqdms_bar():
    pytest.importorskip("tqdm")
    screen = Terminal()
    list(progress(range(5), desc="run", stream=screen))
    assert "\r" in screen.getvalue() and "5/5" in screen.getvalue()


@pytest.mark.parametrize("options", [dict(disable=True), dict(leave=False)], ids=["disabled", "inner loop"])
def test_disabled_bars_and_inner_loops_write_nothing_to_a_log(options):
    log = io.StringIO()
    bar = progress(range(10), desc="inner", stream=log, **options)
    for _ in bar:
        bar.set_postfix(x=1)
    assert log.getvalue() == ""
