"""``python -m spectral_ops.monitor plot LOG_DIR --out FILE.png``: a run's spectral scalars, read back from
the TensorBoard event files under ``LOG_DIR`` (written by the Trainer's or Lightning's callback, or by
``MetricsWriter``), plotted over the steps (docs/monitoring.md)."""

from __future__ import annotations

import argparse

from .core import MATRIX_METRICS
from .plot import PLOTTED, plot_events

# Every metric a monitor logs, by the part of its name after the prefix.
METRICS = (*MATRIX_METRICS, "qk_bound", "decay")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectral_ops.monitor",
                                     description="Spectral monitoring tools (docs/monitoring.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="plot a run's spectral scalars from its TensorBoard event files",
                               description="Plot a run's spectral scalars over the steps, one panel per metric and "
                                           "one line per matrix, from the event files under LOG_DIR.")
    plot.add_argument("log_dir", metavar="LOG_DIR",
                      help="the folder the event files were written into (searched recursively)")
    plot.add_argument("--out", required=True, help="the PNG to write (its folder is created)")
    plot.add_argument("--metrics", nargs="+", choices=METRICS, default=list(PLOTTED), metavar="METRIC",
                      help=f"the panels, in order, from {', '.join(METRICS)} (default: {' '.join(PLOTTED)})")
    plot.add_argument("--prefix", default="spectral",
                      help="the monitor's prefix, the first part of every name (default: spectral)")
    args = parser.parse_args(argv)
    print(plot_events(args.log_dir, args.out, args.metrics, args.prefix))


if __name__ == "__main__":
    main()
