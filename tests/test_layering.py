"""The package's layers: an import runs only downwards (spectral_ops.experiments uses spectral_ops.train,
so train must not use experiments; what both need lives below them, as spectral_ops.reporting)."""

from __future__ import annotations

import ast
from pathlib import Path

import spectral_ops

PACKAGE = Path(spectral_ops.__file__).parent


def imported_modules(path: Path, root: Path = PACKAGE, top_level: bool = False) -> set[str]:
    """The absolute names of the modules (and of the names taken from them) that ``path`` imports,
    relative imports resolved against its package (``root`` is spectral_ops' folder); ``top_level``: only
    the module's own statements, not a function's."""
    package = ["spectral_ops", *path.relative_to(root).parent.parts]
    names = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_imported_modules_resolves_relative_imports(tmp_path):
    source = tmp_path / "train" / "report.py"
    source.parent.mkdir()
    source.write_text("from .. import experiments\nfrom ..experiments.report import x\n"
                      "import spectral_ops.experiments\nfrom .config import TrainConfig\n")
    names = imported_modules(source, root=tmp_path)
    assert {"spectral_ops.experiments", "spectral_ops.experiments.report.x", "spectral_ops.train.config"} <= names


def test_train_does_not_import_experiments():
    offenders = {}
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        names = sorted(name for name in imported_modules(path)
                       if name.split(".")[:2] == ["spectral_ops", "experiments"])
        if names:
            offenders[str(path.relative_to(PACKAGE.parent))] = names
    assert not offenders


# ----- every choice of algorithm is made in the plan (issue #28): nothing else branches on the power

# The layers that run an op or a decay around the plan. The kernels' launchers (_extension.py and
# cuda_backend.py size a fused chain's workspace by p) and the formulas of the oracles, the closed
# forms and the experiments (reference.py, linalg.py's SVD routes, analysis.py, experiments/) are
# not choices of algorithm.
CHOICE_FREE = ["ops.py", "decay.py", "dispatch.py", "tuning.py", "selfcheck.py", "optim/*.py",
               "backends/torch_backend.py", "backends/triton_backend.py", "backends/counting.py"]
POWER_NAMES = {"p", "p_bot", "power"}


def _mentions_power(node: ast.AST) -> bool:
    """Whether ``node`` reads the power itself; passing it to a call (the plan's own decision, e.g.
    ``needs_direction(p, ...)``) is not reading it."""
    if isinstance(node, ast.Call):
        return False
    if (isinstance(node, ast.Name) and node.id in POWER_NAMES
            or isinstance(node, ast.Attribute) and node.attr in POWER_NAMES):
        return True
    return any(_mentions_power(child) for child in ast.iter_child_nodes(node))


def branches_on_power(source: str, filename: str = "<source>") -> list[int]:
    """Lines of ``if``s and conditional expressions that test the power, other than argument checks
    (an ``if`` whose body only raises)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.If) and _mentions_power(node.test):
            if not all(isinstance(statement, ast.Raise) for statement in node.body):
                lines.append(node.lineno)
        elif isinstance(node, (ast.IfExp, ast.While)) and _mentions_power(node.test):
            lines.append(node.lineno)
    return lines


def test_branches_on_power_finds_a_choice_but_not_a_check():
    assert branches_on_power("if p % 2:\n    run_odd()\n") == [1]
    assert branches_on_power("x = a if options.p == 0 else b\n") == [1]
    assert branches_on_power("if p == 0 and mode == 'prox':\n    raise ValueError('no')\n") == []
    assert branches_on_power("if not plan.needs_direction(options.p, lam, band):\n    scale()\n") == []


def test_only_the_plan_chooses_an_algorithm_by_the_power():
    offenders = {}
    for pattern in CHOICE_FREE:
        for path in sorted(PACKAGE.glob(pattern)):
            lines = branches_on_power(path.read_text(), str(path))
            if lines:
                offenders[str(path.relative_to(PACKAGE.parent))] = lines
    assert not offenders, f"branches on p outside spectral_ops/plan/ (move the choice into plan.route): {offenders}"



# ----- the plan is a package of modules read top to bottom, above dispatch (issue #45)

# spectral_ops.plan's modules, in reading order: each imports only those before it.
PLAN_MODULES = ["iterations", "thresholds", "gram", "factorised", "routing", "decay"]


def test_dispatch_imports_nothing_from_the_plan():
    """Dispatch routes the plan's primitive calls: it sits below the plan (the precision tables it reads
    are spectral_ops.precision's, and the plan's composition of a small chain is handed to it)."""
    names = sorted(name for name in imported_modules(PACKAGE / "dispatch.py")
                   if name.split(".")[:2] == ["spectral_ops", "plan"])
    assert not names


def test_the_plans_modules_import_only_those_above_them_and_never_dispatch():
    """Function-level imports aside: the cost model (routing) imports the decay it counts where it
    counts it, since a decay is routed like any op."""
    assert sorted(path.stem for path in (PACKAGE / "plan").glob("*.py")) == sorted(["__init__", *PLAN_MODULES])
    offenders = {}
    for position, name in enumerate(PLAN_MODULES):
        names = imported_modules(PACKAGE / "plan" / f"{name}.py", top_level=True)
        below = {f"spectral_ops.plan.{other}" for other in PLAN_MODULES[position:]} | {"spectral_ops.dispatch"}
        wrong = sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in below))
        if wrong:
            offenders[name] = wrong
    assert not offenders
