"""``python -m spectral_ops.train [train|sweep|report|demo] ...`` (``train`` when omitted).

* ``train``: one run (``--preset``, ``--config FILE.json``, any ``--field value``; ``--resume``).
* ``sweep``: a grid, ``--powers 0 1 2 4 --coefficients 0.01 0.03`` or ``--recipes HHH HHF HHF+p2V``
  (SPEC 7.5, ``--coefficients`` = lambda_V) / ``p1 pA0pM2`` (SPEC 7.6, ``--attention-coefficients`` x
  ``--mlp-coefficients``), optionally ``--lrs``; ``--protocol`` fills in a SPEC 7 protocol's grid;
  writes ``summary.{md,csv,json}``.
* ``report RUN_DIRS... --out DIR``: the plots and tables of ``report.py``.
* ``demo``: the README's main job: the ``tiny`` preset with ``p`` = 1, 2 and 4 at one raw
  coefficient on the standard-library corpus, a comparison table and the report plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import add_config_arguments, config_from_arguments, preset
from .loop import train
from .sweep import GRID_DEFAULTS, MODULE_WISE_POWERS, PROTOCOLS, RECIPES, run_sweep

COMMANDS = ("train", "sweep", "report", "demo")


def _listed(values, spec: str = "g") -> str:
    """Values for a --help line, as the flag takes them (space-separated)."""
    return " ".join(format(value, spec) for value in values)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="python -m spectral_ops.train", description=__doc__.splitlines()[0])
    commands = main.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="one run")
    add_config_arguments(train_parser)
    train_parser.add_argument("--resume", action="store_true",
                              help="continue from the newest loadable checkpoint in OUT_DIR (checkpoint.pt, "
                                   "then checkpoint.1.pt, ...)")
    train_parser.add_argument("--force", action="store_true",
                              help="with --resume: continue even though OUT_DIR/config.json or the checkpoint's "
                                   "embedded config differs from this one in what the run computes (not out_dir or "
                                   "the logging and checkpoint flags), or config.json is unreadable (it is rewritten)")

    sweep_parser = commands.add_parser("sweep", help="a grid of runs")
    add_config_arguments(sweep_parser)
    sweep_parser.add_argument("--out", type=Path, default=Path("runs/sweep"),
                              help="folder of the runs and of summary.{md,csv,json} (default: runs/sweep)")
    response, module_wise = PROTOCOLS["coefficient-response"], PROTOCOLS["module-wise"]
    sweep_parser.add_argument("--protocol", choices=sorted(PROTOCOLS),
                              help="a SPEC 7 protocol's grid: coefficient-response (7.4: p "
                                   f"{_listed(response['grid']['powers'])} x lambda_p "
                                   f"{_listed(response['grid']['coefficients'])}) or module-wise (7.6: recipes "
                                   f"{' '.join(module_wise['grid']['recipes'])} x lr x lambda_A x lambda_M, "
                                   f"{len(module_wise['grid']['lrs'])} values each, "
                                   f"{module_wise['config']['steps']:,} steps); "
                                   "the flags below and --steps override it")
    sweep_parser.add_argument("--powers", type=int, nargs="+",
                              help=f"spectral powers p to sweep (default: {_listed(GRID_DEFAULTS['powers'])})")
    sweep_parser.add_argument("--coefficients", type=float, nargs="+",
                              help="spectral coefficients lambda_p to sweep, or lambda_V of HHF+p2V "
                                   f"(default: {_listed(GRID_DEFAULTS['coefficients'])})")
    sweep_parser.add_argument("--recipes", nargs="+", choices=RECIPES,
                              help="SPEC 7.5/7.6 recipes to sweep instead of powers x coefficients")
    sweep_parser.add_argument("--attention-coefficients", type=float, nargs="+",
                              help=f"lambda_A of the module-wise recipes {' and '.join(MODULE_WISE_POWERS)} "
                                   f"(default: SPEC 7.6's {_listed(GRID_DEFAULTS['attention_coefficients'], '.7g')})")
    sweep_parser.add_argument("--mlp-coefficients", type=float, nargs="+",
                              help="lambda_M of the module-wise recipes (default: as --attention-coefficients)")
    sweep_parser.add_argument("--lrs", type=float, nargs="+",
                              help="peak lrs to sweep as well (default: the config's lr only)")

    report_parser = commands.add_parser("report", help="plots and tables from finished runs")
    report_parser.add_argument("runs", type=Path, nargs="+", help="finished run folders")
    report_parser.add_argument("--out", type=Path, default=Path("runs/report"),
                               help="folder for the plots and tables (default: runs/report)")

    demo_parser = commands.add_parser("demo", help="the README's main job")
    demo_parser.add_argument("--out", type=Path, default=Path("runs/demo"),
                             help="folder of the three runs and the report (default: runs/demo)")
    demo_parser.add_argument("--coefficient", type=float, default=0.3,
                             help="the raw spectral coefficient shared by p = 1, 2 and 4 (default: 0.3)")
    demo_parser.add_argument("--steps", type=int, default=None, help="override the tiny preset's steps")
    return main


def sweep_plan(args: argparse.Namespace):
    """The base config and grid axes of ``sweep``: each axis from its flag, else the protocol's, else
    the default; the protocol's config fields (7.6's steps) sit under the config file and the flags."""
    protocol = PROTOCOLS[args.protocol] if args.protocol else {"grid": {}, "config": {}}
    axes = {name: next(v for v in (getattr(args, name), protocol["grid"].get(name), default) if v is not None)
            for name, default in GRID_DEFAULTS.items()}
    return config_from_arguments(args, protocol["config"]), axes


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "train")
    args = parser().parse_args(argv)
    if args.command == "train":
        train(config_from_arguments(args), resume=args.resume, force=args.force)
    elif args.command == "sweep":
        base, axes = sweep_plan(args)
        run_sweep(base, args.out, **axes)
    elif args.command == "report":
        from .report import report

        print(report(args.runs, args.out))
    else:
        from .report import report

        overrides = {"steps": args.steps} if args.steps else {}
        rows = run_sweep(preset("tiny", **overrides), args.out, powers=[1, 2, 4], coefficients=[args.coefficient])
        report([args.out / row["run"] for row in rows], args.out / "report")
        print(f"\nreport plots and tables: {args.out / 'report'}")


if __name__ == "__main__":
    main()
