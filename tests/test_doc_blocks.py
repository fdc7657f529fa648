"""Every ```python block of README.md and docs/ runs on its own, as a reader would paste it.

Each block runs in a fresh Python process (8 simulated CPU devices, JAX_PLATFORMS=cpu, in a
temporary directory), so a block cannot lean on another one's names: a block that only makes
sense as a fragment says so in its fence, ```python notest, with the reason on its first line
(``# notest: why``). The docs site renders such a block as Python (scripts/mkdocs_hooks.py).
Pages in PENDING are being rewritten by their owners and not converted yet: their blocks are
listed as skipped, failing nothing.

Every block runs with jddp's ``DeprecationWarning`` as an error: the docs teach one spelling,
the policies (only docs/migration.md's table names the old keywords, and no block uses them).
Every block, of any language, fits the column: at most ``COLUMNS`` characters a line.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Pages whose blocks are not converted yet (each owner converts theirs; then remove it here).
PENDING: frozenset[str] = frozenset()
#: At least this many blocks run (README.md and docs/ together, pending pages excluded).
MIN_RUN = 25
#: One block's bound: a block is a small program (a few steps of a small model).
TIMEOUT_S = 240
#: The widest code line the docs' column shows without scrolling (1280 px).
COLUMNS = 85
#: Blocks allowed to be wider (they scroll), by page and first line, each with why.
WIDE: dict[tuple[str, str], str] = {
    ("docs/report.md", "Step program: 8 devices, 2 host(s), 2 collectives"):
        "the report's table as printed (99 columns)",
}
#: Runs a block (argv[1]) as ``python -c`` would, with jddp's deprecations as errors (a
#: DeprecationWarning that names jddp or DataParallel; other libraries' warnings stay warnings).
PRELUDE = (
    "import sys, warnings\n"
    "warnings.filterwarnings('error', r'(?s).*\\b(jddp|DataParallel)\\b', DeprecationWarning)\n"
    "exec(compile(sys.argv[1], '<doc block>', 'exec'))\n"
)
_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>```+)(?P<info>[^`\n]*)$")


class Block(NamedTuple):
    path: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    info: str  # the fence's info string ("python", "python notest", "bash", ...)
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.info.split()[:1] == ["python"]

    @property
    def notest(self) -> bool:
        return self.info.split()[1:2] == ["notest"]


def blocks_of(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, dedented by their fence's indentation."""
    lines = path.read_text().splitlines()
    rel = path.relative_to(ROOT).as_posix()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks = len(m["indent"]), m["ticks"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        body = [ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1:end]]
        found.append(Block(rel, i + 1, m["info"].strip(), "\n".join(body) + "\n"))
        i = end + 1
    return found


def all_blocks(python: bool = True) -> list[Block]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [b for p in pages for b in blocks_of(p) if b.is_python or not python]


BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if not b.notest and b.path not in PENDING]


def test_enough_blocks_run():
    assert len(RUN) >= MIN_RUN, f"only {len(RUN)} python blocks run; the docs promise {MIN_RUN}"


def test_code_blocks_fit_the_column():
    """A line wider than the column hides its end behind a scroll bar (usually the comment that
    explains it): every block's lines fit ``COLUMNS`` characters."""
    wide = []
    for block in all_blocks(python=False):
        lines = block.code.splitlines()
        if (block.path, lines[0] if lines else "") in WIDE:
            continue
        wide += [f"{block.path}:{block.line + 1 + i}: {len(ln)} columns"
                 for i, ln in enumerate(lines) if len(ln) > COLUMNS]
    assert not wide, f"code lines wider than {COLUMNS} columns:\n" + "\n".join(wide)


def test_a_run_fails_on_a_jddp_deprecation(tmp_path):
    """The net under every block: an old keyword in a block fails it."""
    code = ("import jax.numpy as jnp, optax, jddp\n"
            "jddp.DataParallel(lambda p, b: jnp.sum(p), optax.sgd(0.1), zero_stage=1)\n")
    out = _run(Block("x.md", 1, "python", code), tmp_path)
    assert out.returncode != 0 and "DeprecationWarning" in out.stderr, out.stderr[-2000:]
    assert "zero_stage" in out.stderr


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.notest], ids=lambda b: b.id)
def test_a_block_that_does_not_run_says_why(block):
    first = block.code.lstrip("\n").splitlines()[0] if block.code.strip() else ""
    assert re.match(r"#\s*notest:\s*\S", first), (
        f"{block.id}: a ```python notest block starts with '# notest: <why it cannot run>'")


def _run(block: Block, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    try:
        return subprocess.run([sys.executable, "-c", PRELUDE, block.code], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: the block did not finish within {TIMEOUT_S} s")


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.notest], ids=lambda b: b.id)
def test_block_runs(block, tmp_path):
    if block.path in PENDING:
        pytest.skip(f"{block.path} is not converted yet (PENDING in {pathlib.Path(__file__).name})")
    out = _run(block, tmp_path)
    assert out.returncode == 0, (
        f"{block.id} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def _tutorial_script() -> str:
    """The ``train.py`` of docs/tutorial.md: its first python block."""
    return next(b for b in blocks_of(ROOT / "docs" / "tutorial.md") if b.is_python).code


@pytest.mark.slow
def test_tutorial_script_runs_under_jddp_run_and_resumes_with_zero3_offload(tmp_path):
    """The tutorial's path after one CPU: the same train.py as 2 processes x 2 devices under
    jddp-run for 5 steps, then run again (a resume from step 5) with ZeRO-3 and offload."""
    from launch_util import child_env, compile_cache

    (tmp_path / "train.py").write_text(_tutorial_script())
    env = child_env(JAX_PLATFORMS="cpu", **compile_cache(tmp_path / "cache"))

    def jddp_run(**extra: str) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process", "2",
               "--timeout", "150", "train.py"]
        try:  # jddp-run's --timeout ends the job (and its ranks) first
            out = subprocess.run(cmd, cwd=tmp_path, env=dict(env, **extra), timeout=200,
                                 capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            pytest.fail("jddp-run train.py did not end within 200 s")
        return out.returncode, out.stdout[-2000:] + out.stderr[-4000:]

    rc, log = jddp_run(STEPS="5")
    assert rc == 0 and "steps 0..5 on 4 devices" in log, f"first run (exit {rc}):\n{log}"
    rc, log = jddp_run(STEPS="8", ZERO3="1")
    assert rc == 0 and "steps 5..8 on 4 devices" in log, f"resume with ZeRO-3 (exit {rc}):\n{log}"
