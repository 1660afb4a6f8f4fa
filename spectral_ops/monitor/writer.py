"""A plain training loop's metrics where users read them: TensorBoard event files (the ``tensorboard``
package, through torch's ``SummaryWriter``) and a CSV with one row per log step (docs/monitoring.md).

The hosts with a logger of their own (the Trainer, Lightning) log through it instead (:mod:`.transformers`,
:mod:`.lightning`); this is for a loop that has none.
"""

from __future__ import annotations

import csv
import numbers
from pathlib import Path

CSV_NAME = "metrics.csv"


class MetricsWriter:
    """Writes ``{name: number}`` at a step into ``log_dir``: a TensorBoard event file (one scalar per name,
    tagged by it) and ``log_dir/metrics.csv`` (a ``step`` column, then one column per name).

    The CSV's columns are those of the first row written, and stay: every later row must hold the same names
    (a :class:`ValueError` names the difference, before anything of that row is written). A ``metrics.csv``
    already in ``log_dir`` (a resumed run) is appended to, under the same rule against its header; TensorBoard
    reads the new event file next to the old ones. Each row is flushed to both files as it is written, so
    TensorBoard shows a running job and a killed one leaves whole rows. A context manager (closes both files).
    """

    def __init__(self, log_dir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch's writer needs the tensorboard package, which torch does not require
            raise ImportError("MetricsWriter writes TensorBoard event files with the tensorboard package: "
                              "pip install tensorboard") from error
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.log_dir / CSV_NAME
        self.columns = _header(self.csv_path)  # None until the first row where the file is new
        self._csv = open(self.csv_path, "a", newline="")
        self._rows = csv.writer(self._csv)
        self._events = SummaryWriter(str(self.log_dir))

    def write(self, step: int, metrics: dict) -> None:
        """One row: ``metrics`` (``{name: real number}``, e.g. :meth:`SpectralMonitor.compute`'s) at ``step``."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        bad = {name: value for name, value in metrics.items()
               if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, numbers.Real)}
        if bad:
            raise TypeError(f"metrics must map names (str) to real numbers; not: {bad!r}")
        names = list(metrics)
        if self.columns is None:
            self.columns = names
            self._rows.writerow(["step", *names])
        elif set(names) != set(self.columns):
            missing, extra = sorted(set(self.columns) - set(names)), sorted(set(names) - set(self.columns))
            raise ValueError(f"{self.csv_path} has the columns of its first row; this row lacks {missing} and adds "
                             f"{extra}: write the same names at every step, or use another log_dir")
        # str(float) is the shortest repr that reads back to the same float: the CSV holds the values exactly.
        self._rows.writerow([int(step), *(float(metrics[name]) for name in self.columns)])
        for name in self.columns:
            self._events.add_scalar(name, float(metrics[name]), global_step=int(step))
        self._csv.flush()
        self._events.flush()

    def close(self) -> None:
        self._events.close()
        self._csv.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _header(path: Path) -> list[str] | None:
    """The metric columns of an existing CSV (its header after ``step``), None where there is none yet."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, newline="") as handle:
        header = next(csv.reader(handle), [])
    if header[:1] != ["step"]:
        raise ValueError(f"{path} is not a metrics CSV (its header does not begin with 'step'); "
                         f"choose another log_dir")
    return header[1:]

