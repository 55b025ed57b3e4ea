"""The layer table of docs/ARCHITECTURE.md is the import rule: every module of the package
imports only its own layer and the layers its row lists, so the table and the code cannot
drift apart. Also checked: the Rules section's "never import" sentences, "lazily" (package
imports only inside functions), "only inside its functions" (third-party imports), that
every package and root module has a row, and that no two modules of a package import each
other (even lazily).
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "pyspark_safetensors"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE_NAME = "pyspark_safetensors"
ROOT_LAYER = "pyspark_safetensors"
"""The row of the package root, ``__init__.py``."""
ANY_LAYER_MAY_IMPORT = ("_version", "errors")
"""Root modules over nothing but ``format``, which the Rules let every layer import: the
version (read there, never from the package root) and the error base's re-export."""


@dataclass(frozen=True)
class Rule:
    """One row of the table: the layers it may import, and how."""

    allowed: frozenset[str]
    everything: bool
    """"everything": any layer."""
    lazily: bool
    """Package imports only inside functions, except those in ``at_import``."""
    at_import: frozenset[str]


def _entries(column: str) -> list[str]:
    """The column split on commas and semicolons outside parentheses."""
    entries, depth, current = [], 0, ""
    for ch in column:
        depth += ch == "("
        depth -= ch == ")"
        if ch in ",;" and depth == 0:
            entries.append(current.strip())
            current = ""
        else:
            current += ch
    return [e for e in [*entries, current.strip()] if e]


def layer_table() -> dict[str, Rule]:
    """``{layer: Rule}`` from the table whose header is ``| layer | what it owns | imports |``."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*layer\s*\|", line))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.match(r"`?([\w.]+)", cells[0]).group(1)  # `cli`, `pyspark_safetensors` (...)
        layers, at_import, everything, lazily = set(), set(), False, False
        for entry in _entries(cells[-1].replace("`", "")):
            head = re.split(r"[\s(]", entry, maxsplit=1)[0]
            if entry.endswith("lazily"):
                lazily = True
            if head == "everything":
                everything = True
            elif head != "lazily":
                layers.add(head)
                if "at import" in entry:
                    at_import.add(head)
        rows[name] = Rule(frozenset(layers), everything, lazily, frozenset(at_import))
    return rows


def never_rules() -> list[tuple[str, str]]:
    """``(layer, what it never imports)`` from the Rules' "`a` and `b` never import x or y"
    and "never import each other"."""
    text = ARCHITECTURE.read_text()
    rules_text = " ".join(text[text.index("Rules:") :].split("\n\n", 2)[:2]).replace("\n", " ")
    pairs = []
    for clause in re.split(r";|\.\s", rules_text):
        m = re.search(r"((?:`\w+`(?:,\s*|\s+and\s+)?)+)\s+never import\s+([\w ,]+)", clause)
        if not m:
            continue
        subjects = re.findall(r"`(\w+)`", m.group(1))
        objects = m.group(2).strip()
        if objects.startswith("each other"):
            pairs += [(a, b) for a in subjects for b in subjects if a != b]
        else:
            for obj in re.split(r",\s*|\s+or\s+|\s+and\s+", objects):
                pairs += [(s, obj.strip()) for s in subjects if obj.strip()]
    return pairs


def only_inside_functions() -> list[tuple[str, str]]:
    """``(layer, third-party module)`` from "`a` imports x, y and z only inside its functions"."""
    text = ARCHITECTURE.read_text().replace("\n", " ")
    pairs = []
    for m in re.finditer(r"`(\w+)` imports ([\w ,]+?) only inside its functions", text):
        for obj in re.split(r",\s*|\s+and\s+", m.group(2)):
            pairs.append((m.group(1), obj.strip()))
    return pairs


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, e.g. ``pyspark_safetensors.extract.job``."""
    path: Path
    line: int
    target: str
    """The imported module, absolute."""
    lazy: bool
    """Inside a function: runs on call, not at import."""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, path.name == "__init__.py"


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.dump(
        node.test
    )


def _walk(node, lazy=False):
    """(import node, lazy) for every import, skipping ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def imports() -> list[Import]:
    found = []
    for name, path, is_package in _modules():
        package = name if is_package else name.rpartition(".")[0]
        for node, lazy in _walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import sub`: the submodule when it is one, else the package
                targets = [
                    f"{base}.{a.name}"
                    if (PACKAGE.parent / base.replace(".", "/") / a.name).exists()
                    or (PACKAGE.parent / base.replace(".", "/") / f"{a.name}.py").exists()
                    else base
                    for a in node.names
                ]
            found += [Import(name, path, node.lineno, t, lazy) for t in dict.fromkeys(targets)]
    return found


def layer_of(module: str) -> str:
    """The table row a module of the package belongs to: its folder under the package, or
    the module itself at the root (``cli``, ``errors``, ...); the root ``__init__`` is
    ``pyspark_safetensors``."""
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT_LAYER
    return parts[1]


def _where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT)}:{imp.line}"


def test_the_table_parses_into_the_layers_we_know():
    table = layer_table()
    assert {"format", "dataset", "spark", "torch", "extract", "interop", "sae", "lut"} <= set(table)
    assert table["format"].allowed == {"numpy", "ml_dtypes"}
    assert table["cli"].everything and table["cli"].lazily
    assert ("format", "pyspark") in never_rules() and ("spark", "torch") in never_rules()
    assert ("extract", "transformers") in only_inside_functions()


def test_every_package_and_root_module_has_a_row():
    table = layer_table()
    missing = sorted({layer_of(name) for name, _, _ in _modules()} - set(table))
    assert not missing, (
        f"{', '.join(missing)}: no row in the layer table of docs/ARCHITECTURE.md; add "
        "'| `name` | what it owns | the layers it may import |' so its imports can be checked"
    )


def test_every_import_follows_the_layer_table():
    table = layer_table()
    problems = []
    for imp in imports():
        if not imp.target.startswith(PACKAGE_NAME):
            continue
        source, target = layer_of(imp.module), layer_of(imp.target)
        rule = table.get(source)
        if rule is None or target == source or target in ANY_LAYER_MAY_IMPORT:
            continue  # an unknown layer is reported by the test above
        if target not in table:
            problems.append(f"{_where(imp)}: {imp.module} imports {imp.target}, whose layer "
                            f"'{target}' has no row in the table")  # fmt: skip
        elif not (rule.everything or target in rule.allowed):
            problems.append(f"{_where(imp)}: {imp.module} imports {imp.target}; the table lets "
                            f"'{source}' import {sorted(rule.allowed)} only")  # fmt: skip
        elif rule.lazily and not imp.lazy and target not in rule.at_import:
            problems.append(f"{_where(imp)}: {imp.module} imports {imp.target} at import time; "
                            f"the table says '{source}' imports it lazily (inside functions)")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_rules_never_imports_and_function_only_imports_hold():
    never, lazy_only = never_rules(), only_inside_functions()
    problems = []
    for imp in imports():
        source = layer_of(imp.module)
        top = imp.target.split(".")[0]
        # a layer of ours ("never import each other") or a third-party module ("pyspark")
        imported = layer_of(imp.target) if top == PACKAGE_NAME else top
        for layer, forbidden in never:
            if source == layer and imported == forbidden:
                problems.append(f"{_where(imp)}: {imp.module} imports {imp.target}; rule: "
                                f"'{layer}' never imports {forbidden}")  # fmt: skip
        for layer, module in lazy_only:
            if source == layer and top == module and not imp.lazy:
                problems.append(f"{_where(imp)}: {imp.module} imports {module} at import time; "
                                f"rule: '{layer}' imports it only inside its functions")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_function_level_and_relative_imports_are_found():
    found = {(i.module, i.target): i.lazy for i in imports()}
    # `from pyspark import StorageLevel` inside _run_model: found, and lazy
    assert found[("pyspark_safetensors.extract.job", "pyspark")] is True
    # `from ..dataset import DatasetLocation` at the top: resolved, and at import time
    assert found[("pyspark_safetensors.extract.job", "pyspark_safetensors.dataset")] is False
    # `from . import loader` in a module __getattr__: the submodule, lazy
    assert found[("pyspark_safetensors.interop.zarr", "pyspark_safetensors.interop.zarr.loader")]


def _sibling_imports() -> dict[str, set[str]]:
    """``{module: the modules of its own package it imports}``, lazily or not (a package's
    ``__init__`` is its parent's module, so re-exports are not edges)."""
    modules = {name for name, _, _ in _modules()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports():
        target = imp.target
        while target not in modules and "." in target:  # `from .run import X`: the module
            target = target.rpartition(".")[0]
        parent = imp.module.rpartition(".")[0]
        if target != imp.module and target.rpartition(".")[0] == parent:
            graph[imp.module].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path, stack = [], [(start, iter(sorted(graph[start])))]
        while stack:
            node, edges = stack[-1]
            if not path or path[-1] != node:
                path.append(node)
            nxt = next(edges, None)
            if nxt is None:
                done.add(node)
                stack.pop()
                path.pop()
            elif nxt in path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_no_package_has_an_import_cycle_between_its_modules():
    cycle = _cycle(_sibling_imports())
    assert cycle is None, (
        f"{' -> '.join(cycle)}: modules of one package import each other (lazily counts); "
        "move what they share (an error, a constant) into a module of its own"
    )


def test_the_cycle_check_sees_a_lazy_cycle():
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.a"}}) == ["p.a", "p.b", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": set()}) is None
    graph = _sibling_imports()
    assert "pyspark_safetensors.pipeline.errors" in graph["pyspark_safetensors.pipeline.vision"]
    # `from .vision import image_set` inside a method of run.py: a (lazy) edge
    assert "pyspark_safetensors.pipeline.vision" in graph["pyspark_safetensors.pipeline.run"]


#: The longest function the package may hold: past it, a function is cut into named steps.
LONGEST_FUNCTION = 80


def test_no_function_is_longer_than_the_limit():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"
