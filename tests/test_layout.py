"""The package layout: every import in tplayers points down the layer stack of DESIGN.md
("Layout"), kernels never touch torch.distributed, `import tplayers` does not import triton,
and no module grows past the size where it should be split."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"tplayers": ROOT / "tplayers", "tplayers.kernels": ROOT / "kernels"}

# Lower numbers are lower layers; a module may import its own layer and those below it.
LAYERS = {
    "tplayers.kernels": 0,
    "tplayers.backend": 1,
    "tplayers.distributed": 1,
    "tplayers.placement": 1,
    "tplayers.state": 1,
    "tplayers.tolerances": 1,
    "tplayers.functional": 2,
    "tplayers.nn": 3,
    "tplayers.train": 4,
    "tplayers.data_parallel": 4,
    "tplayers.pipeline": 4,
    "tplayers.hf": 5,
    "tplayers.checkpoint": 6,
    "tplayers": 7,  # the root package: the public names, gathered from every layer below
    "tplayers.loops": 7,  # others' training loops (HF Trainer, accelerate) on checkpoint, hf, train
    "tplayers.plan": 8,
    "tplayers.tools": 9,
    "tplayers.testing": 9,
}
MAX_LINES = 600
# The contract spells the loop integrations `tplayers.hf.Trainer` / `parallel_trainer` / `prepare`;
# `tplayers.hf` names them from `tplayers.loops` on first use, in its module `__getattr__` only
# (eagerly, `import tplayers` would import transformers' Trainer and accelerate: seconds).
LAZY_NAMES = {("tplayers.hf", "tplayers.loops")}


def modules():
    """(dotted name, path) of every module of tplayers, kernels included."""
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            if package == "tplayers" and (ROOT / "kernels") in path.parents:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def layer_of(module: str) -> str:
    """The LAYERS key a dotted module name belongs to (the longest matching prefix)."""
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS and DESIGN.md")
    return best


def _exists(module: str) -> bool:
    rel = module.split(".")
    folder = PACKAGE_DIRS["tplayers.kernels"] if rel[:2] == ["tplayers", "kernels"] else PACKAGE_DIRS["tplayers"]
    parts = rel[2:] if rel[:2] == ["tplayers", "kernels"] else rel[1:]
    base = folder.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, top level or inside functions, with
    relative imports resolved; `from pkg import name` counts as `pkg.name` where that is a module."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if base.startswith("tplayers") and _exists(sub) else base))
    return found


def _lazy_lines(source: str) -> set[int]:
    """The lines of the module-level `__getattr__` functions in `source`."""
    tree = ast.parse(source)
    return {
        line
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        for line in range(node.lineno, node.end_lineno + 1)
    }


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every import of `module` that points up the stack, or kernels importing torch.distributed."""
    own = layer_of(module)
    bad = []
    lazy = _lazy_lines(source)
    for line, target in imports_of(module, source, is_package):
        if line in lazy and any(module == m and layer_of(target) == t for m, t in LAZY_NAMES):
            continue
        if own == "tplayers.kernels" and target.startswith("torch.distributed"):
            bad.append(f"{module}:{line} imports {target}: kernels never touch torch.distributed")
        if target != "tplayers" and not target.startswith("tplayers."):
            continue
        theirs = layer_of(target)
        if LAYERS[theirs] > LAYERS[own]:
            bad.append(f"{module}:{line} ({own}, layer {LAYERS[own]}) imports {target} (layer {LAYERS[theirs]})")
    return bad


def test_imports_point_down_the_stack():
    bad = []
    for module, path in modules():
        bad += violations(module, path.read_text(), path.name == "__init__.py")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, source",
    [
        ("tplayers.nn.linear", "from tplayers.hf import parallelize"),
        ("tplayers.functional.overlap", "def f():\n    from tplayers.nn.mlp import ParallelMLP"),
        ("tplayers.train.step", "import tplayers"),
        ("tplayers.hf.shard", "from tplayers import plan"),
        ("tplayers.plan.validate", "from tplayers.tools import demo"),
        ("tplayers.kernels.matmul", "from ..backend import gemm"),
        ("tplayers.kernels.matmul", "import torch.distributed as dist"),
        ("tplayers.hf", "from tplayers.loops import Trainer"),  # eager: only __getattr__ may
        ("tplayers.hf.shard", "def __getattr__(name):\n    from tplayers.loops import Trainer"),
    ],
)
def test_negative_control_upward_imports_are_found(module, source):
    assert violations(module, source), f"{source!r} in {module} should be flagged"


def test_allowed_imports_pass():
    assert not violations("tplayers.hf.parallelize", "from tplayers.nn.linear import ColumnParallelLinear")
    assert not violations("tplayers.tools.cli", "from tplayers.plan import cli\nimport tplayers")
    assert not violations("tplayers.kernels.matmul", "from .matmul_ref import matmul_ref")
    assert not violations("tplayers.hf", "def __getattr__(name):\n    from tplayers.loops import Trainer", True)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the tplayers modules it imports, at the top or inside a function} of `sources`
    ({module: (source, is_package)}), leaving out only the lazy re-exports the contract asks for
    (LAZY_NAMES, inside a module `__getattr__`)."""
    graph = {}
    for module, (source, is_package) in sources.items():
        lazy = _lazy_lines(source)
        graph[module] = {
            target
            for line, target in imports_of(module, source, is_package)
            if target in sources and target != module
            and not (line in lazy and any(module == m and layer_of(target) == t for m, t in LAZY_NAMES))
        }  # fmt: skip
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or round a loop: the strongly connected
    components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles():
    """Modules import one way: a circle (module-level or inside a function) is refused. The one
    exception is the contract's lazy re-export of the loops' names from `tplayers.hf`."""
    sources = {module: (path.read_text(), path.name == "__init__.py") for module, path in modules()}
    circles = import_circles(import_graph(sources))
    assert not circles, "modules importing each other (move what both use into a module both import):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


CIRCLES = {
    "lazy-pair": {
        "tplayers.nn.linear": "def f():\n    from tplayers.nn.grid import GridLinear",
        "tplayers.nn.grid": "from tplayers.nn.linear import check_input",
    },
    "three-round": {
        "tplayers.plan.specs": "from tplayers.plan import presets",
        "tplayers.plan.presets": "from tplayers.plan import layout",
        "tplayers.plan.layout": "def f():\n    import tplayers.plan.specs",
    },
    "getattr-not-in-contract": {
        "tplayers.hf.shard": "def __getattr__(name):\n    from tplayers.hf.lora import x",
        "tplayers.hf.lora": "from tplayers.hf.shard import y",
    },
}


@pytest.mark.parametrize("sources", CIRCLES.values(), ids=CIRCLES)
def test_negative_control_import_circles_are_found(sources):
    graph = import_graph({module: (source, False) for module, source in sources.items()})
    assert import_circles(graph) == [sorted(sources)]


def test_the_contracts_lazy_re_export_is_no_circle():
    sources = {"tplayers.hf": ("def __getattr__(name):\n    from tplayers.loops import Trainer", True),
               "tplayers.loops": ("from tplayers.hf import parallelize", True)}  # fmt: skip
    assert import_circles(import_graph(sources)) == []


def test_every_module_has_a_layer_and_stays_small():
    too_long = []
    for module, path in modules():
        layer_of(module)
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            too_long.append(f"{module}: {n} lines")
    assert not too_long, f"split these modules (over {MAX_LINES} lines): {too_long}"


def test_import_tplayers_does_not_import_triton():
    """Nor transformers, which imports triton itself (TRITON_INTERPRET must be set before it)."""
    code = (
        "import sys, tplayers, tplayers.plan, tplayers.testing; "
        "print([m for m in ('triton', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


ATTRIBUTE_NAMES = re.compile(r"_tplayers_[a-z_]+")


def attribute_names(sources) -> set[str]:
    """The `_tplayers_*` names in `sources`: the attributes tplayers writes onto others' objects."""
    return {name for source in sources for name in ATTRIBUTE_NAMES.findall(source)}


def test_tplayers_keeps_its_state_under_two_attribute_names():
    """One State per object (tplayers.state) and the placement records' per-module table."""
    names = attribute_names(path.read_text() for _, path in modules())
    assert names <= {"_tplayers_state", "_tplayers_records"}, names


def test_negative_control_attribute_names_are_found():
    assert attribute_names(['setattr(model, "_tplayers_exports", records)', "x._tplayers_state"]) == {
        "_tplayers_exports",
        "_tplayers_state",
    }
