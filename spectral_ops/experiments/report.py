"""What an experiment's report quotes besides its results (the writing itself is :mod:`spectral_ops.reporting`)."""

from __future__ import annotations


def command_line(name: str, out_dir, quick: bool, **options) -> str:
    """The command that reproduces an experiment's files, quoted in its report (None options omitted)."""
    flags = "".join(f" --{key} {value}" for key, value in options.items() if value is not None)
    return f"python -m spectral_ops.experiments {name} --out {out_dir}" + (" --quick" if quick else "") + flags
