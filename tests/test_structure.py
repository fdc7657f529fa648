"""The package's dependency rules, checked on the source with ``ast`` (nothing is imported).

1. No import cycle between jddp modules, counting module-level imports (top-level statements,
   also inside top-level ``if``/``try`` blocks, **including** ``if TYPE_CHECKING:``: a cycle that
   only type checkers see is still two modules that need each other; not inside functions).
2. No module uses another jddp module's private (``_``-prefixed) names: neither
   ``from jddp.x import _name`` nor ``x._name`` on an imported jddp module, wherever it appears.
   Importing the modules of the private package ``jddp._src`` is fine; the rule is about names.

There is no allow-list: every module of the package keeps both rules.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "jddp"

def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module level (descending into top-level if/try blocks, ``TYPE_CHECKING``
    included)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _module_level(block)
            for handler in node.handlers:
                yield from _module_level(handler.body)
        else:
            yield node


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


class Package:
    """The modules of the package ``name`` under ``root``, read with ``ast``."""

    def __init__(self, root: pathlib.Path, name: str = PACKAGE) -> None:
        self.name = name
        self.files: dict[str, pathlib.Path] = {}
        for path in sorted((root / name).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.files[".".join(parts)] = path
        self.trees = {m: ast.parse(p.read_text(), str(p)) for m, p in self.files.items()}

    def _resolve(self, importer: str, level: int, module: str | None) -> str:
        """The absolute module name of a (possibly relative) ``from ... import`` source."""
        if not level:
            return module or ""
        base = importer.split(".")
        if self.files[importer].name != "__init__.py":
            base.pop()
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def imported(self, importer: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
        """(module imported, name imported from it, or "") for each package name of ``node``.

        For ``from pkg import name`` the module is ``pkg.name`` if that is a module, else ``pkg``.
        """
        if isinstance(node, ast.Import):
            return [(a.name, "") for a in node.names if a.name.split(".")[0] == self.name]
        source = self._resolve(importer, node.level, node.module)
        if source.split(".")[0] != self.name:
            return []
        out = []
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            out.append((sub, "") if sub in self.files else (source, alias.name))
        return out

    def import_graph(self) -> dict[str, set[str]]:
        """Module -> the package's modules its module-level imports load."""
        graph: dict[str, set[str]] = {}
        for module, tree in self.trees.items():
            edges = set()
            for node in _module_level(tree.body):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    edges.update(m for m, _ in self.imported(module, node) if m != module)
            graph[module] = edges
        return graph

    def private_uses(self, module: str) -> list[str]:
        """Uses of other modules' private names in ``module`` (anywhere in its source)."""
        found = []
        aliases: dict[str, str] = {}  # local name -> the module it is bound to
        tree = self.trees[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == self.name:
                        aliases[alias.asname or self.name] = alias.name if alias.asname else self.name
            elif isinstance(node, ast.ImportFrom) and node.names[0].name != "*":
                pairs = self.imported(module, node)
                if not pairs:  # not from this package
                    continue
                for (source, name), alias in zip(pairs, node.names, strict=True):
                    if name and _private(name) and source != module:
                        found.append(f"{module}: from {source} import {name}")
                    elif not name:
                        aliases[alias.asname or alias.name] = source
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = self._module_of(node.value, aliases)
                is_module = f"{target}.{node.attr}" in self.files  # e.g. jddp._src: allowed
                if target is not None and target != module and not is_module:
                    found.append(f"{module}: {target}.{node.attr}")
        return sorted(set(found))

    def _module_of(self, node: ast.expr, aliases: dict[str, str]) -> str | None:
        """The module an expression such as ``buckets_lib`` or ``jddp.perf.schedule`` names."""
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            parent = self._module_of(node.value, aliases)
            if parent is not None and f"{parent}.{node.attr}" in self.files:
                return f"{parent}.{node.attr}"
        return None

    def violations(self, modules: list[str] | None = None) -> set[str]:
        """Every private-name use and every import cycle (touching ``modules``, default all)."""
        modules = list(self.files) if modules is None else modules
        found = {v for m in modules for v in self.private_uses(m)}
        for cycle in cycles(self.import_graph()):
            if set(cycle) & set(modules):
                found.add("cycle: " + " <-> ".join(cycle))
        return found


JDDP = Package(ROOT)


# ------------------------------------------------------------------------------------- tests


def test_the_checker_sees_the_package():
    graph = JDDP.import_graph()
    assert {"jddp", "jddp._src.tree", "jddp.perf", "jddp.perf.schedule"} <= set(graph)
    assert "jddp.perf.costmodel" in graph["jddp.perf.calibrate"]
    assert "jddp._src.introspect.hlo" in graph["jddp.perf.schedule"]
    assert "jddp._src.core.bytemodel" in graph["jddp._src.introspect.hlo.schedule"]


def test_checker_finds_cycles_and_private_uses(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from typing import TYPE_CHECKING\n"
                                             "if TYPE_CHECKING:\n    from jddp import b\n")
    (pkg / "a.py").write_text("from jddp import b as b_lib\nX = b_lib._hidden\n")
    (pkg / "b.py").write_text("import jddp.a\nfrom . import a\n\ndef f():\n    return a._y\n")
    (pkg / "c.py").write_text("def f():\n    from jddp import a\n")  # not at module level
    (pkg / "sub" / "d.py").write_text(
        "from ..a import _z\nfrom jddp.a import __doc__\nimport jddp.sub\nV = jddp.a._w\n"
        "W = jddp._priv.x\nfrom jddp._priv import x\n"
    )
    (pkg / "_priv").mkdir()
    (pkg / "_priv" / "__init__.py").write_text("")
    (pkg / "_priv" / "x.py").write_text("")
    fake = Package(tmp_path)
    assert cycles(fake.import_graph()) == [["jddp.a", "jddp.b"]]
    # An import under TYPE_CHECKING counts; one inside a function does not.
    assert fake.import_graph()["jddp.sub"] == {"jddp.b"} and fake.import_graph()["jddp.c"] == set()
    assert fake.private_uses("jddp.a") == ["jddp.a: jddp.b._hidden"]
    assert fake.private_uses("jddp.b") == ["jddp.b: jddp.a._y"]
    assert fake.private_uses("jddp.sub.d") == [
        "jddp.sub.d: from jddp.a import _z", "jddp.sub.d: jddp.a._w"
    ]
    assert "cycle: jddp.a <-> jddp.b" in fake.violations()
    # A cycle closed only by a TYPE_CHECKING import (config <-> local_sgd had one) is a cycle.
    (pkg / "e.py").write_text("from jddp import f\n")
    (pkg / "f.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from jddp.e import X\n")
    assert ["jddp.e", "jddp.f"] in cycles(Package(tmp_path).import_graph())


def test_no_import_cycles_and_no_private_names_across_modules():
    found = sorted(JDDP.violations())
    assert not found, "dependency rule violations:\n" + "\n".join(found)


MAX_FUNCTION_LINES = 80


def long_functions(root: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function (methods and nested functions included,
    from ``def`` through its last line) under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent.parent)}:{node.lineno} "
                                 f"{node.name} ({lines} lines)")
    return found


def test_src_imports_no_public_module():
    """``jddp._src`` is the implementation: it never imports a public module (``jddp.perf``
    included: the cost model the default plan uses lives in ``jddp._src.plan.costmodel``)."""
    graph = JDDP.import_graph()
    public = {(m, d) for m, deps in graph.items() if m.startswith("jddp._src")
              for d in deps if not d.startswith("jddp._src")}
    assert not public, sorted(public)
    assert "jddp._src.plan.costmodel" in graph["jddp._src.plan.modelcap"]


def test_the_length_check_counts_whole_functions(tmp_path):
    src = tmp_path / "pkg" / "_src"
    src.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (src / "m.py").write_text(f"def long():\n{body}\n\n\nclass C:\n    def ok(self):\n"
                              "        def inner():\n            pass\n")
    assert long_functions(src) == ["pkg/_src/m.py:1 long (81 lines)"]
    assert long_functions(src, limit=81) == []


def test_no_function_in_src_over_80_lines():
    found = long_functions(ROOT / PACKAGE / "_src")
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(found)


FENCE = f"{PACKAGE}._src.introspect"


def _imported_modules(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` of every import anywhere in a module (function-local ones included);
    ``names`` is empty for ``import x``. Relative imports are not used in jddp (ruff's TID252)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, [a.name for a in node.names]


def fence_violations(root: pathlib.Path, api: set[str]) -> list[str]:
    """Imports of private JAX outside the fence, and imports of the fence's modules other than
    its listed ``api`` (the names of ``jddp._src.introspect.__all__``), from any module."""
    package_dir = root / PACKAGE
    fence_dir = package_dir / "_src" / "introspect"
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        if fence_dir in path.parents:
            continue
        where = path.relative_to(root)
        for module, names in _imported_modules(ast.parse(path.read_text(), str(path))):
            if module == "jax._src" or module.startswith("jax._src."):
                found.append(f"{where}: imports {module}")
            elif module == FENCE:
                found += [f"{where}: from {module} import {n}" for n in names if n not in api]
            elif module.startswith(FENCE + "."):
                if module.removeprefix(FENCE + ".").split(".")[0] not in api:
                    found.append(f"{where}: imports {module}")
    return found


def _fence_api(root: pathlib.Path) -> set[str]:
    """The names ``__all__`` lists in ``jddp/_src/introspect/__init__.py`` (read from source)."""
    tree = ast.parse((root / PACKAGE / "_src" / "introspect" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("jddp/_src/introspect/__init__.py has no __all__")


def test_the_fence_checker_finds_private_jax_and_unlisted_modules(tmp_path):
    fence = tmp_path / PACKAGE / "_src" / "introspect"
    fence.mkdir(parents=True)
    (fence / "__init__.py").write_text("__all__ = ['hlo']\n")
    (fence / "jax_private.py").write_text("from jax._src import distributed\n")  # allowed here
    (tmp_path / PACKAGE / "a.py").write_text(
        "import jax._src.xla_bridge\nfrom jddp._src.introspect import hlo\n"
        "def f():\n    from jax._src import distributed\n"
        "    from jddp._src.introspect import jax_private\n"
        "    import jddp._src.introspect.other\n    from jddp._src.introspect.hlo import X\n")
    api = _fence_api(tmp_path)
    assert api == {"hlo"}
    assert fence_violations(tmp_path, api) == [
        "jddp/a.py: imports jax._src.xla_bridge",
        "jddp/a.py: imports jax._src",
        "jddp/a.py: from jddp._src.introspect import jax_private",
        "jddp/a.py: imports jddp._src.introspect.other",
    ]


def test_private_jax_only_inside_the_introspect_package():
    """No module of jddp outside ``jddp._src.introspect`` imports ``jax._src`` (at any depth, in
    functions too), and others reach the fence only through the modules its ``__all__`` lists."""
    api = _fence_api(ROOT)
    assert api == {"hlo", "jax_private", "jaxpr", "vma"}
    found = fence_violations(ROOT, api)
    assert not found, "imports across the introspection fence:\n" + "\n".join(found)
    fenced = [p for p in sorted((ROOT / PACKAGE / "_src" / "introspect").glob("*.py"))
              if any(m.startswith("jax._src")
                     for m, _ in _imported_modules(ast.parse(p.read_text())))]
    assert [p.name for p in fenced] == ["jax_private.py"], "private JAX belongs in jax_private.py"


# The policy families of jddp/_src: a placement, a reducer, an update wrapper and a sync policy
# each live in their family's package and never import another family (the skeleton composes
# them). Shared primitives live below them in core/ (and tree.py, introspect/, api/options.py).
FAMILIES = ("place", "reduce", "update", "sync")
# The edges that remain, each named with why (the next refactor's list, not a licence):
CROSSING: set[tuple[str, str]] = set()
CORE_MAY_IMPORT = ("jddp._src.tree", "jddp._src.core", "jddp._src.introspect",
                   "jddp._src.api.options")
# The precision policy names DDP's built-in cast hooks for its reduce dtype (a call-time import).
CORE_CROSSING = {("jddp/_src/core/precision.py", "jddp._src.reduce.hooks.cast")}


def _src_imports(family: str) -> Iterator[tuple[str, str]]:
    """``(module path, imported jddp module)`` of every import (at any depth) in one package."""
    for path in sorted((ROOT / PACKAGE / "_src" / family).rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for module, names in _imported_modules(ast.parse(path.read_text(), where)):
            if not module.startswith(f"{PACKAGE}."):
                continue
            base = ROOT.joinpath(*module.split("."))
            subs = [n for n in names if base.joinpath(n).with_suffix(".py").exists()
                    or base.joinpath(n).is_dir()]  # `from pkg import module`
            yield from ((where, f"{module}.{n}") for n in subs)
            if len(subs) < len(names) or not names:
                yield where, module


def test_policy_families_never_import_each_other():
    """Placements, reducers, update wrappers and sync policies reach each other only through
    the skeleton (``jddp._src.step``) and the shared ``core``: no family imports another's
    modules, except the edges ``CROSSING`` names."""
    found = set()
    for family in FAMILIES:
        for where, module in _src_imports(family):
            other = module.split(".")[2] if module.count(".") >= 2 else ""
            if other in FAMILIES and other != family:
                found.add((where, module))
    assert found - CROSSING == set(), "policy families import each other:\n" + "\n".join(
        f"{w}: {m}" for w, m in sorted(found - CROSSING))
    assert CROSSING <= found, f"a named crossing is gone, drop it from CROSSING: {CROSSING - found}"


def test_core_imports_no_policy_family():
    """``jddp._src.core`` (the leaves' split, backend-safe collectives, precision dtypes) sits
    below every family: it imports only tree, core, introspect and the option validators."""
    found = {(w, m) for w, m in _src_imports("core") if not m.startswith(CORE_MAY_IMPORT)}
    assert found == CORE_CROSSING, sorted(found)
