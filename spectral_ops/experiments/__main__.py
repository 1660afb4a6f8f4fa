"""``python -m spectral_ops.experiments NAME --out DIR [--quick] [pure-decay options]``."""

from __future__ import annotations

import argparse

from . import EXPERIMENTS, run

PURE_DECAY_OPTIONS = ("checkpoint", "horizon", "coefficients")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectral_ops.experiments",
                                     description="Run a reference experiment; write NAME.md, NAME.json and NAME.png.")
    parser.add_argument("name", choices=list(EXPERIMENTS))
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--quick", action="store_true", help="reduced settings that run in seconds")
    from .pure_decay import COEFFICIENTS, HORIZON

    parser.add_argument("--checkpoint", help="pure-decay only: the checkpoint to decay: checkpoint.pt of "
                        "python -m spectral_ops.train (or its run folder), or a state dict saved with torch.save "
                        "(default: a synthetic one)")
    parser.add_argument("--horizon", type=float, help=f"pure-decay only: the fixed horizon T of the checkpoint "
                        f"decay ds/dt = -lambda s^p (default {HORIZON:g})")
    parser.add_argument("--coefficients", type=float, nargs="+", metavar="LAMBDA",
                        help="pure-decay only: the decay coefficients lambda applied to the checkpoint (default "
                             f"{' '.join(f'{lam:g}' for lam in COEFFICIENTS)})")
    args = parser.parse_args(argv)
    options = {key: getattr(args, key) for key in PURE_DECAY_OPTIONS if getattr(args, key) is not None}
    if options and args.name != "pure-decay":
        parser.error(f"{', '.join(f'--{key}' for key in options)} applies to pure-decay only")
    print(run(args.name, args.out, quick=args.quick, **options))


if __name__ == "__main__":
    main()
