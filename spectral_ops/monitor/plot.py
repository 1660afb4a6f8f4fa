"""Reading a run's spectral scalars back from its TensorBoard event files, and plotting them over the steps
(``python -m spectral_ops.monitor plot``, docs/monitoring.md).

Whichever host wrote them: a tag holds ``{prefix}.{metric}/{name}`` after the host's own prefix, if any (the
Trainer writes ``train/spectral.s_max/...``, Lightning and :class:`~.writer.MetricsWriter` the name as is).
"""

from __future__ import annotations

import re
from pathlib import Path

# What the figure shows by default: the three quantities SPEC 3 and SPEC 11 are about.
PLOTTED = ("s_max", "stable_rank", "qk_bound")
# A log axis where a metric's values span decades across matrices (an embedding against a head's block).
LOG_SCALE = {"s_max", "frobenius", "qk_bound", "effective_lr"}
# Up to this many lines a panel has a legend and a colour per line (matplotlib's tab20); beyond, a legend
# would hide the curves: the panel names its largest and smallest at the end instead.
LEGEND_LINES = 20


def read_events(log_dir, prefix: str = "spectral") -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{metric: {name: [(step, value), ...]}}`` from every event file under ``log_dir`` (TensorBoard's
    reader; a step written twice, as by a resumed run, keeps its last value), steps ascending."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    if not Path(log_dir).is_dir():
        raise FileNotFoundError(f"{log_dir}: no such folder (give the folder the event files were written into)")
    # size_guidance 0: every point (the default keeps a sample of 1,000 per tag).
    multiplexer = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(log_dir)).Reload()
    pattern = re.compile(rf"(?:^|/){re.escape(prefix)}\.([a-z_]+)/(.+)$")
    found: dict[str, dict[str, dict[int, float]]] = {}
    for run in sorted(multiplexer.Runs()):
        accumulator = multiplexer.GetAccumulator(run)
        for tag in accumulator.Tags()["scalars"]:
            match = pattern.search(tag)
            if match:
                points = found.setdefault(match[1], {}).setdefault(match[2], {})
                points.update((event.step, event.value) for event in accumulator.Scalars(tag))
    if not found:
        raise ValueError(f"{log_dir}: no event file under it holds a {prefix}.* scalar (was it written with "
                         f"prefix={prefix!r}?)")
    return {metric: {name: sorted(points.items()) for name, points in sorted(names.items())}
            for metric, names in found.items()}


def plot_events(log_dir, out, metrics=PLOTTED, prefix: str = "spectral") -> Path:
    """One panel per metric of ``metrics`` that the event files hold, one line per matrix (or attention
    module), over the steps; written to ``out`` (PNG). Returns its path."""
    from .. import reporting  # matplotlib, headless

    series = read_events(log_dir, prefix)
    shown = [metric for metric in metrics if metric in series]
    if not shown:
        raise ValueError(f"{log_dir}: none of {list(metrics)} was logged; it holds {sorted(series)}")
    plt = reporting.plt
    figure, axes = plt.subplots(len(shown), 1, figsize=(8, 3.2 * len(shown)), squeeze=False)
    for axis, metric in zip(axes[:, 0], shown):
        lines = series[metric]
        colours = plt.get_cmap("tab20").colors
        for index, (name, points) in enumerate(lines.items()):
            steps, values = zip(*points)
            axis.plot(steps, values, label=name, linewidth=1, color=colours[index % len(colours)])
        axis.set_ylabel(metric)
        if metric in LOG_SCALE:
            axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        if len(lines) <= LEGEND_LINES:
            axis.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        else:
            last = {name: points[-1][1] for name, points in lines.items()}
            top, bottom = max(last, key=last.get), min(last, key=last.get)
            axis.set_title(f"{len(lines)} lines; at the end largest {top}, smallest {bottom}", fontsize=7)
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=reporting.FIGURE_DPI)
    plt.close(figure)
    return out
