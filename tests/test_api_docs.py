"""docs/api.md is generated from the docstrings (docs/gen_api.py) and must be current."""

import importlib.util
import pathlib

import jddp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_md_is_up_to_date():
    expected = _gen_api().render()
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == expected, "docs/api.md is out of date: run python docs/gen_api.py"


def test_design_module_map_is_up_to_date():
    gen = _gen_api()
    current = (ROOT / "docs" / "design.md").read_text()
    assert current == gen.render_design(current), (
        "the module map in docs/design.md is out of date: run python docs/gen_api.py"
    )
    for path in (ROOT / "jddp").rglob("*.py"):  # every module is in it
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        assert f"| `{name}` |" in current, name


def test_every_public_name_is_documented():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in jddp.__all__:
        assert f"jddp.{name}" in text
    public = _gen_api().public_modules("jddp")
    assert {m.__name__ for m in public} >= {"jddp.hooks", "jddp.mesh", "jddp.nnx", "jddp.trainer"}
    for module in public:
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in text
    modules = _gen_api().subpackage_modules("jddp.perf")
    assert {m.__name__ for m in modules} >= {"jddp.perf.costmodel", "jddp.perf.schedule"}
    for module in modules:
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in text


def test_package_is_typed():
    assert (ROOT / "jddp" / "py.typed").exists()


def test_documented_arguments_sit_in_their_args_section():
    """An argument documented after another section (DataParallel's local_sgd once followed the
    Metrics paragraph) renders as loose text in api.md, outside the argument list."""
    import inspect
    import re

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
    api = (ROOT / "docs" / "api.md").read_text()
    block = api.split("### `jddp.DataParallel`", 1)[1].split("\n### ", 1)[0]
    for p in inspect.signature(jddp.DataParallel.__init__).parameters:
        if p not in ("self", "renamed"):
            assert f"\n- {p}: " in block, p
