"""The API reference (docs/api/, rendered by mkdocstrings from the docstrings) covers the public
API, and the module map of docs/design.md (scripts/module_map.py) is current."""

import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import types

import jddp

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
_DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.MULTILINE)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _public_modules(package):
    """The public modules of ``package`` (no leading ``_``, subpackages included), by name."""
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{package}.{n}") for n in names]


def _directives():
    """Every ``::: name`` of docs/api/*.md, and the pages that hold them."""
    found = {}
    for page in sorted(API.glob("*.md")):
        for name in _DIRECTIVE.findall(page.read_text()):
            found.setdefault(name, []).append(page.name)
    return found


def test_design_module_map_is_up_to_date():
    gen = _script("module_map")
    current = (ROOT / "docs" / "design.md").read_text()
    assert current == gen.render_design(current), (
        "the module map in docs/design.md is out of date: run python scripts/module_map.py"
    )
    for path in (ROOT / "jddp").rglob("*.py"):  # every module is in it
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        assert f"| `{name}` |" in current, name


def test_every_public_module_has_its_api_section():
    """mkdocstrings renders a module's ``__all__``; each public module needs one directive."""
    found = _directives()
    modules = [jddp, *_public_modules("jddp"), *_public_modules("jddp.perf")]
    assert {m.__name__ for m in modules} >= {"jddp.hooks", "jddp.trainer", "jddp.perf.costmodel"}
    missing = [m.__name__ for m in modules if m.__name__ not in found]
    assert not missing, f"no '::: name' section in docs/api/ for {missing}"
    for module in modules:
        names = getattr(module, "__all__", None)
        if module.__name__ != "jddp.perf":  # the subpackage's modules are its API
            assert names, f"{module.__name__} has no __all__ (mkdocstrings would guess its API)"
        for name in names or ():
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"
    stale = [n for n in found if n != "jddp" and not _importable(n)]
    assert not stale, f"docs/api/ documents names that do not exist: {stale}"


def _importable(name):
    module, _, attr = name.rpartition(".")
    try:
        return isinstance(importlib.import_module(name), types.ModuleType)
    except ImportError:
        return hasattr(importlib.import_module(module), attr)


def test_every_api_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in API.glob("*.md"):
        assert f"api/{page.name}" in nav, page.name


def test_package_is_typed():
    assert (ROOT / "jddp" / "py.typed").exists()


def test_documented_arguments_sit_in_their_args_section():
    """An argument documented after another section (DataParallel's local_sgd once followed the
    Metrics paragraph) renders as loose text, outside the argument list; and every argument of
    DataParallel is in its Args (the API page is where the options are listed)."""
    for name in jddp.__all__:
        obj = getattr(jddp, name)
        doc = inspect.getdoc(obj)
        if not doc or not callable(obj):
            continue
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            params = set(inspect.signature(target).parameters) - {"self"}
        except (TypeError, ValueError):
            continue
        section = None
        for line in doc.splitlines():
            if re.match(r"^[A-Z][A-Za-z ]*:\s*$", line):
                section = line.strip()[:-1]
            elif line.strip() and not line.startswith(" "):
                section = None  # a paragraph ends the section
            m = re.match(r"^\s{2,4}(\w+): ", line)
            if m and m.group(1) in params:
                assert section in ("Args", "Attributes"), (
                    f"{name}: argument {m.group(1)!r} documented outside Args")
    doc = inspect.getdoc(jddp.DataParallel)
    args = doc.split("\nArgs:\n", 1)[1]
    for p in inspect.signature(jddp.DataParallel.__init__).parameters:
        if p not in ("self", "renamed"):
            assert re.search(rf"^\s{{2,4}}{p}: ", args, re.MULTILINE), p


def test_site_hooks_render_notest_fences_as_python_and_roles_as_code():
    """The docs site's two source filters (mkdocs.yml loads them; skipped without the docs extra)."""
    import pytest

    pytest.importorskip("mkdocs")
    pytest.importorskip("griffe")
    hooks = _script("mkdocs_hooks")
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="x.md"))
    md = "```python notest\n# notest: why\nx = 1\n```\n![plot](../benchmarks/out/peers.png)\n"
    assert hooks.on_page_markdown(md, page=page) == (
        "```python\nx = 1\n```\n![plot](benchmarks/out/peers.png)\n")
    rst = _script("griffe_rst")
    assert rst.markdown("See :func:`plan_buckets` and :class:`~jddp.buckets.BucketPlan`. "
                        "Example::\n") == (
        "See `plan_buckets` and `jddp.buckets.BucketPlan`. Example:\n")


#: Old keywords that are no field of any policy nor an argument elsewhere: never written bare.
_OLD_ONLY = ("zero_stage", "hybrid_shard", "accumulator_dtype", "accum_dtype",
             "shard_accumulator", "mixed_precision", "skip_not_finite", "skip_nonfinite",
             "bucket_plan", "local_sgd")


def _old_keywords_in_calls(text, old):
    """``(keyword, line)`` for each deprecated keyword passed to a ``DataParallel(`` call in
    ``text`` (at the call's own level, over several lines)."""
    found = []
    for m in re.finditer(r"DataParallel\(", text):
        depth, i, args = 1, m.end(), []
        while i < len(text) and depth:
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
            args.append(text[i] if depth == 1 else " ")
            i += 1
        nnx = text[max(0, m.start() - 4):m.start()] == "nnx."
        for k in re.findall(r"\b(\w+)\s*=(?!=)", "".join(args)):
            if k in old and not (nnx and k == "has_aux"):  # jddp.nnx's own has_aux
                found.append((k, text.count("\n", 0, m.start()) + 1))
    return found


def test_docs_docstrings_and_examples_teach_only_the_policies():
    """One spelling: no deprecated keyword of DataParallel in the docs, the docstrings or the
    examples, except the migration page's table of old and new spellings (and the module that
    maps them)."""
    from jddp._src.api.deprecated import OWNERS

    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "jddp").rglob("*.py"))]
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "jddp/_src/api/deprecated.py":
            continue
        text = path.read_text()
        if rel == "docs/migration.md":  # its table names the old keywords on purpose
            text = "\n".join("" if ln.startswith("|") else ln for ln in text.splitlines())
        bad += [f"{rel}:{line}: DataParallel({k}=...)" for k, line in
                _old_keywords_in_calls(text, OWNERS)]
        for m in re.finditer(rf"`+({'|'.join(_OLD_ONLY)})=", text):
            bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}=")
    assert not bad, "deprecated keywords taught as current:\n" + "\n".join(bad)


def test_public_docstrings_name_no_private_module():
    """The API pages show no private name: no docstring of a public object (or of its public
    methods) points into ``jddp._src``."""
    modules = [jddp, *_public_modules("jddp"), *_public_modules("jddp.perf")]
    not_rendered = {"jddp.trainer.StepConfig"}  # filtered off the page (internal wiring)
    # Rendered without their members (members: false in docs/api/index.md): the step's protocol.
    policies = {"Accumulate", "Buckets", "Deterministic", "EveryStep", "Loss", "Replicate",
                "SkipNotFinite", "ZeRO"}
    bad = []
    for module in modules:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if f"{module.__name__}.{name}" in not_rendered or isinstance(obj, types.ModuleType):
                continue
            members = [obj, *(v for k, v in vars(obj).items() if not k.startswith("_"))] \
                if inspect.isclass(obj) and name not in policies else [obj]
            for member in members:
                doc = inspect.getdoc(member) if callable(member) or inspect.isclass(member) \
                    else None
                if doc and re.search(r"jddp[./]_src", doc):
                    bad.append(f"{module.__name__}.{name}: {getattr(member, '__name__', '')}")
        if re.search(r"jddp[./]_src", inspect.getdoc(module) or ""):
            bad.append(module.__name__)
    assert not bad, f"public docstrings that name private modules: {sorted(set(bad))}"


def test_site_keeps_code_names_whole():
    """The docs build fails on CSS that lets a code name break between two letters (mkdocs-
    material's own inline code breaks anywhere until docs/css/extra.css says otherwise), and on
    inline code too long for a phone's column; names break only after punctuation."""
    import pytest

    pytest.importorskip("mkdocs")
    hooks = _script("mkdocs_hooks")
    assert hooks.css_problems((ROOT / "docs" / "css" / "extra.css").read_text()) == []
    broken = ".md-typeset table:not([class]) code {\n  word-break: normal;\n"
    assert hooks.css_problems(broken + "  overflow-wrap: anywhere;\n}\n")
    assert hooks.css_problems(".md-typeset code { word-break: break-all; }")
    html = "<p><code>jddp.local_sgd.post_local_sgd(x, y)</code></p>"
    assert hooks.break_points(html) == (
        "<p><code>jddp.<wbr>local_sgd.<wbr>post_local_sgd(<wbr>x, y)</code></p>")
    assert hooks.break_points("<pre><span></span><code>a.b</code></pre>").count("<wbr>") == 0
    long = "<p><code>" + "a_b" * 20 + "</code></p>"
    assert hooks.unbreakable(long) == ["a_b" * 20]
    assert hooks.unbreakable(f"<table>{long}</table>") == []  # a table scrolls instead
