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


def test_every_public_name_is_documented():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in jddp.__all__:
        assert f"jddp.{name}" in text
    for name in jddp.nnx.__all__:
        assert f"jddp.nnx.{name}" in text
    modules = _gen_api().subpackage_modules("jddp.perf")
    assert {m.__name__ for m in modules} >= {"jddp.perf.costmodel", "jddp.perf.schedule"}
    for module in modules:
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in text


def test_package_is_typed():
    assert (ROOT / "jddp" / "py.typed").exists()
