"""``jddp.perf``'s submodules are reachable as attributes without their own import (issue 35:
``jddp.perf.profile`` raised AttributeError after ``import jddp``)."""

import subprocess
import sys

from tests.launch_util import REPO, child_env


def _run(code: str) -> list[str]:
    """The lines ``python -c code`` prints in a fresh process (its own imports)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_perf_submodules_import_on_first_attribute_access():
    code = (
        "import sys, jddp\n"
        "assert 'jddp.perf.profile' not in sys.modules  # importing jddp stays light\n"
        "print(jddp.perf.profile.StepTimer.__name__, jddp.perf.schedule.__name__)\n"
        "print(sorted(set(jddp.perf.SUBMODULES) - set(dir(jddp.perf))))\n"
        "try:\n"
        "    jddp.perf.nonexistent\n"
        "except AttributeError as e:\n"
        "    print('AttributeError', e)\n"
    )
    lines = _run(code)
    assert lines[0] == "StepTimer jddp.perf.schedule"
    assert lines[1] == "[]"
    assert lines[2] == "AttributeError module 'jddp.perf' has no attribute 'nonexistent'"


def test_import_jddp_loads_neither_the_cost_model_nor_the_hlo_reader():
    """Both load where they are used (the default plan on CPU, reports, program checks,
    ``jddp.perf``), not with ``import jddp``; a report then loads the HLO reader."""
    code = (
        "import sys, jddp\n"
        "print(sorted(m for m in sys.modules if m in ('jddp._src.plan.costmodel',\n"
        "                                             'jddp._src.introspect.hlo')))\n"
        "from jddp._src.plan import traffic\n"
        "traffic.traffic('HloModule m', [0])\n"
        "print('jddp._src.introspect.hlo' in sys.modules)\n"
    )
    assert _run(code) == ["[]", "True"]


def test_the_launcher_imports_no_jax_and_every_public_name_resolves():
    """``import jddp`` imports each public name on first use: ``jddp-run`` (which only starts and
    watches processes, 50-100 of them in the test suite) starts in ~0.1 s instead of ~2 s of
    importing JAX; every name of ``jddp.__all__`` and every submodule is still there."""
    code = (
        "import sys, jddp, jddp.launch\n"
        "print(sorted(m for m in ('jax', 'numpy', 'optax') if m in sys.modules))\n"
        "import jddp._src.step.trainer as t, jddp.hooks\n"
        "assert jddp.DataParallel is t.DataParallel and jddp.hooks is sys.modules['jddp.hooks']\n"
        "assert set(jddp.__all__) <= set(dir(jddp)) and 'hooks' in dir(jddp)\n"
        "ns = {}\n"
        "exec('from jddp import *', ns)\n"
        "print(sorted(n for n in jddp.__all__ if ns[n] is not getattr(jddp, n)))\n"
    )
    assert _run(code) == ["[]", "[]"]
