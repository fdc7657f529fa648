"""pyproject.toml: the license is an SPDX expression (PEP 639) with a setuptools floor that reads
it, so installs print no ``SetuptoolsDeprecationWarning`` about a TOML-table license (issue 35;
checked by hand: ``pip install -v --no-deps -e .`` in a fresh venv, setuptools 84.2.1, printed no
warning)."""

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_license_is_an_spdx_string_with_a_setuptools_floor_that_supports_it():
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not {text = ...}: deprecated
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req)
    assert floor and int(floor.group(1)) >= 77, req  # 77.0.0 reads SPDX license strings
