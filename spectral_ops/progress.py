"""Progress of long work (training, experiments, tuning), shown as suits where it goes.

On a terminal it is tqdm's live bar. Anywhere else (a log file, CI, ``make demo > log``) tqdm would
write every refresh behind a carriage return, about a thousand of them per run, so there it is whole
lines, sparse: one at the start, one each time another ``LINE_PERCENT`` of a known total is done
(at most ``LINE_SECONDS`` apart without a total) and one at the end.
"""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # a dependency, but a bare checkout on a GPU machine (bench/gpu_check.py) may lack it
    tqdm = None

LINE_PERCENT = 5
LINE_SECONDS = 10.0


def progress(iterable, *, desc: str, total: int | None = None, initial: int = 0, unit: str = "it",
             leave: bool = True, disable: bool = False, stream=None):
    """``iterable``, showing its progress on ``stream`` (standard error). ``total`` and ``initial``
    count as tqdm's do (a resumed run starts at ``initial`` of ``total``); ``leave=False`` marks an
    inner loop, which only a terminal shows. The result also has tqdm's ``set_postfix(**values)``."""
    stream = stream or sys.stderr
    if disable or (not leave and not _is_terminal(stream)):
        return _Quiet(iterable)
    if total is None and hasattr(iterable, "__len__"):
        total = initial + len(iterable)
    if _is_terminal(stream) and tqdm is not None:
        return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, leave=leave, file=stream,
                    dynamic_ncols=True)
    return LineProgress(iterable, desc=desc, total=total, initial=initial, unit=unit, stream=stream)


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _Quiet:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **values) -> None:
        pass


class LineProgress:
    """Progress as whole lines (see the module's description), e.g.
    ``train-small: 45/100 steps (45%), 12.3 s, loss=2.345``."""

    def __init__(self, iterable, *, desc: str, total: int | None, initial: int, unit: str, stream):
        self.iterable, self.desc, self.total, self.unit, self.stream = iterable, desc, total, unit, stream
        self.done = initial
        self.postfix = ""

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def __iter__(self):
        start = last_time = time.monotonic()
        last_share = self._share()
        self._line(start)
        reported = None  # the count the last timed line gave
        for item in self.iterable:
            yield item
            self.done += 1
            now = time.monotonic()
            share = self._share()
            if share > last_share if share is not None else now - last_time >= LINE_SECONDS:
                self._line(start, now)
                reported, last_share, last_time = self.done, share, now
        if reported != self.done:
            self._line(start, time.monotonic())

    def _share(self):
        """How many ``LINE_PERCENT`` steps of the total are done (None without a total)."""
        return None if not self.total else self.done * 100 // (LINE_PERCENT * self.total)

    def _line(self, start: float, now: float | None = None) -> None:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        percent = f" ({100 * self.done // self.total}%)" if self.total else ""
        elapsed = f", {now - start:.1f} s" if now is not None else ""
        postfix = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {count} {self.unit}{percent}{elapsed}{postfix}", file=self.stream, flush=True)
