"""``python -m spectral_ops.experiments NAME --out DIR [--quick] [pure-decay or stability options]``."""

from __future__ import annotations

import argparse

from . import EXPERIMENTS, run

# The options an experiment takes besides --out and --quick.
EXPERIMENT_OPTIONS = {"pure-decay": ("checkpoint", "horizon", "coefficients"),
                      "stability": ("preset", "device", "workers", "methods")}


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
    parser.add_argument("--preset", choices=("tiny", "small"),
                        help="stability only: the training preset (default tiny)")
    parser.add_argument("--device", help="stability only: cpu or cuda (default cpu)")
    parser.add_argument("--workers", type=int, help="stability only: runs at once, each in a process of one thread "
                        "(default 1: one after the other, in this process)")
    parser.add_argument("--methods", type=lambda text: tuple(text.split(",")),
                        help="stability only: the methods to run, comma-separated (default: all)")
    args = parser.parse_args(argv)
    options = {key: getattr(args, key) for keys in EXPERIMENT_OPTIONS.values() for key in keys
               if getattr(args, key) is not None}
    foreign = [key for key in options if key not in EXPERIMENT_OPTIONS.get(args.name, ())]
    if foreign:
        owner = next(name for name, keys in EXPERIMENT_OPTIONS.items() if foreign[0] in keys)
        parser.error(f"{', '.join(f'--{key}' for key in foreign)} applies to {owner} only")
    print(run(args.name, args.out, quick=args.quick, **options))


if __name__ == "__main__":
    main()
