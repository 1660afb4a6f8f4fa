"""The package's layers: every import runs downwards, those inside functions too.

The layers, top to bottom (README, "Architecture"), are :data:`LAYERS`; each module of the package sits in
exactly one. A module imports only from its own layer and those below, and the imports, module-level and
function-level alike, form no circle. The only import left out is one under ``if TYPE_CHECKING:``, which
never runs. A lazy import inside a function is still an arrow: the module below would know the one above.
"""

from __future__ import annotations

import ast
import graphlib
import shutil
from pathlib import Path

import pytest

import spectral_ops

PACKAGE = Path(spectral_ops.__file__).parent

# Top to bottom. A module is named relative to the package ("" is spectral_ops/__init__.py, the public
# facade), and a package's name places all of its modules.
LAYERS = {
    "training, metrics and experiments": ("", "__main__", "train", "experiments", "monitor", "metrics", "analysis",
                                          "reporting"),
    "optimizers": ("optim",),
    "API": ("ops", "decay", "decay_options", "matrix_views", "qk_cap", "step_tuning"),
    "plan": ("plan",),
    "dispatch": ("dispatch", "tuning", "gpu_model", "selfcheck"),
    "backends": ("backends", "_extension"),
    "foundations": ("_checks", "_compile", "_version", "build_config", "coefficients", "compat", "deprecations",
                    "environment", "linalg", "precision", "progress", "provenance", "reference"),
}


def module_names(root: Path, package: str = "spectral_ops") -> dict[str, Path]:
    """Every module under ``root`` (the package's folder) by its dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _statements(body: list[ast.stmt]):
    """Every statement under ``body``, in functions and classes too, but not under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If) and isinstance(node.test, (ast.Name, ast.Attribute)) and \
                (getattr(node.test, "id", None) or getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from _statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _statements(getattr(node, field, []))
        for case in getattr(node, "cases", []):
            yield from _statements(case.body)


def imported_modules(path: Path, name: str, modules) -> set[str]:
    """The modules of ``modules`` (dotted names) that the module ``name`` at ``path`` imports anywhere, inside
    functions too: ``from X import y`` imports the module ``X.y`` where there is one, else ``X``; relative
    imports are resolved against the module's package."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in _statements(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{module}.{alias.name}" for alias in node.names} & set(modules)
            found.update(submodules or {module})
    return (found & set(modules)) - {name}


def import_graph(root: Path = PACKAGE, package: str = "spectral_ops") -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def layer_of(module: str, package: str = "spectral_ops") -> int | None:
    """The rank of ``module``'s layer in :data:`LAYERS` (0 is the top), None where no layer names it."""
    relative = module.removeprefix(package).removeprefix(".")
    for rank, members in enumerate(LAYERS.values()):
        if relative in members or relative.split(".")[0] in members:
            return rank
    return None


def upward_imports(graph: dict[str, set[str]], package: str = "spectral_ops") -> list[str]:
    """``"importer -> imported"`` for each import of a module in a higher layer than the importer's."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if layer_of(target, package) < layer_of(module, package))


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules, the first repeated at the end), or [] where there is none."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_every_module_sits_in_one_layer():
    """A new module gets its layer here, the place that says where it may import from."""
    unplaced = [name for name in module_names(PACKAGE) if layer_of(name) is None]
    members = [member for layer in LAYERS.values() for member in layer]
    assert not unplaced, f"add these modules to a layer of LAYERS (README, 'Architecture'): {unplaced}"
    assert len(members) == len(set(members))


def test_imports_run_only_downwards_function_level_imports_counted():
    graph = import_graph()
    assert not upward_imports(graph), "move the function to the layer whose names it uses (README, 'Architecture')"
    assert not import_circle(graph)


def test_a_function_level_import_is_read_and_one_under_type_checking_is_not(tmp_path):
    source = tmp_path / "train" / "report.py"
    source.parent.mkdir()
    source.write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from ..optim import base\n"
                      "def report():\n    try:\n        from .. import experiments\n    finally:\n        pass\n"
                      "class Report:\n    def plot(self):\n        from ..experiments.report import x\n"
                      "import spectral_ops.metrics\nfrom .config import TrainConfig\n")
    modules = ["spectral_ops.experiments", "spectral_ops.experiments.report", "spectral_ops.metrics",
               "spectral_ops.optim", "spectral_ops.optim.base", "spectral_ops.train.config"]
    assert imported_modules(source, "spectral_ops.train.report", modules) == {
        "spectral_ops.experiments", "spectral_ops.experiments.report", "spectral_ops.metrics",
        "spectral_ops.train.config"}


@pytest.mark.parametrize("planted", [
    ("dispatch.py", "def _chosen():\n    from .optim import SpectralAdamW\n    return SpectralAdamW\n"),
    ("plan/gram.py", "def _counted():\n    from .costs import cost\n    return cost\n"),
])
def test_a_planted_upward_import_fails_the_check(tmp_path, planted):
    """The package's own sources, with one lazy import planted in a function: an upward one (dispatch
    importing an optimizer), and one that closes a circle inside the plan (gram importing the cost model)."""
    root = tmp_path / "spectral_ops"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    file, function = planted
    with open(root / file, "a") as handle:
        handle.write("\n\n" + function)
    graph = import_graph(root)
    if file == "dispatch.py":
        assert upward_imports(graph) == ["spectral_ops.dispatch -> spectral_ops.optim"]
    else:
        assert import_circle(graph) and not upward_imports(graph)


def test_train_does_not_import_experiments():
    """Within the top layer: spectral_ops.experiments uses spectral_ops.train, so train must not use
    experiments; what both need lives below them, as spectral_ops.reporting."""
    offenders = {module: sorted(t for t in targets if t.startswith("spectral_ops.experiments"))
                 for module, targets in import_graph().items() if module.startswith("spectral_ops.train")}
    assert not {module: targets for module, targets in offenders.items() if targets}


# ----- every choice of algorithm is made in the plan (issue #28): nothing else branches on the power

# The layers that run an op or a decay around the plan. The kernels' launchers (_extension.py and
# cuda_backend.py size a fused chain's workspace by p) and the formulas of the oracles, the closed
# forms and the experiments (reference.py, linalg.py's SVD routes, analysis.py, experiments/) are
# not choices of algorithm.
CHOICE_FREE = ["ops.py", "decay.py", "dispatch.py", "tuning.py", "step_tuning.py", "selfcheck.py", "optim/*.py",
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



# ----- the plan is a package of modules read top to bottom, above dispatch (issues #45, #53)

# spectral_ops.plan's modules, in reading order: each imports only those before it.
PLAN_MODULES = ["iterations", "thresholds", "gram", "factorised", "routing", "decay", "costs"]


def test_dispatch_imports_nothing_from_the_plan():
    """Dispatch routes the plan's primitive calls: it sits below the plan (the precision tables it reads
    are spectral_ops.precision's, and the plan's composition of a small chain is handed to it)."""
    assert not {t for t in import_graph()["spectral_ops.dispatch"] if t.startswith("spectral_ops.plan")}


def test_the_plans_modules_import_only_those_above_them_and_never_dispatch():
    """Function-level imports counted: routing weighs its iterations with the counting of
    spectral_ops.backends, and the cost model, which counts the decay too, comes after it."""
    assert sorted(path.stem for path in (PACKAGE / "plan").glob("*.py")) == sorted(["__init__", *PLAN_MODULES])
    graph = import_graph()
    offenders = {}
    for position, name in enumerate(PLAN_MODULES):
        below = {f"spectral_ops.plan.{other}" for other in PLAN_MODULES[position:]} | {"spectral_ops.dispatch"}
        wrong = sorted(graph[f"spectral_ops.plan.{name}"] & below)
        if wrong:
            offenders[name] = wrong
    assert not offenders
