"""``python -m spectral_ops.experiments NAME --out DIR [--quick]``."""

from __future__ import annotations

import argparse

from . import EXPERIMENTS, run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectral_ops.experiments",
                                     description="Run a reference experiment; write NAME.md, NAME.json and NAME.png.")
    parser.add_argument("name", choices=list(EXPERIMENTS))
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--quick", action="store_true", help="reduced settings that run in seconds")
    parser.add_argument("--checkpoint", help="pure-decay only: a state dict saved with torch.save to decay")
    args = parser.parse_args(argv)
    options = {}
    if args.checkpoint is not None:
        if args.name != "pure-decay":
            parser.error("--checkpoint applies to pure-decay only")
        options["checkpoint"] = args.checkpoint
    print(run(args.name, args.out, quick=args.quick, **options))


if __name__ == "__main__":
    main()
