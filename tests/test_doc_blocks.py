"""Every ```python block of README.md and docs/ runs on its own, as a reader would paste it.

Each block runs in a fresh Python process (8 simulated CPU devices, JAX_PLATFORMS=cpu, in a
temporary directory), so a block cannot lean on another one's names: a block that only makes
sense as a fragment says so in its fence, ```python notest, with the reason on its first line
(``# notest: why``). The processes are forked from one that imported JAX, jddp, optax, Flax and
Orbax once (no JAX backend started), so that the blocks do not pay those imports each. The docs
site renders a notest block as Python (scripts/mkdocs_hooks.py).
Pages in PENDING are being rewritten by their owners and not converted yet: their blocks are
listed as skipped, failing nothing.

Every block runs with jddp's ``DeprecationWarning`` as an error: the docs teach one spelling,
the policies (only docs/migration.md's table names the old keywords, and no block uses them).
Every block, of any language, fits the column: at most ``COLUMNS`` characters a line.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
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
#: The blocks run with jddp's deprecations as errors: a DeprecationWarning that names jddp or
#: DataParallel (other libraries' warnings stay warnings).
JDDP_DEPRECATION = r"(?s).*\b(jddp|DataParallel)\b"
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


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.notest], ids=lambda b: b.id)
def test_a_block_that_does_not_run_says_why(block):
    first = block.code.lstrip("\n").splitlines()[0] if block.code.strip() else ""
    assert re.match(r"#\s*notest:\s*\S", first), (
        f"{block.id}: a ```python notest block starts with '# notest: <why it cannot run>'")


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    return env


#: The zygote (run as ``python -c``): imports what the blocks import, then per request (a JSON
#: line: code, cwd, out, err) forks a child that runs the code as ``python -c`` would (a fresh
#: ``__main__``, JDDP_DEPRECATION an error) in its own process group, its stdout and stderr in
#: files; answers the child's pid, then its exit status (a line each). The imports start no JAX
#: backend (each child starts its own, after the block's own settings such as XLA_FLAGS) and no
#: thread that fork would break.
ZYGOTE = r"""
import json, os, sys, types, warnings
JDDP_DEPRECATION = sys.argv[1]
import numpy, jax, jax.numpy, optax, flax.linen, flax.nnx, orbax.checkpoint
import jddp, jddp.checkpoint
for name in (*jddp.__all__, "data", "evaluation", "hooks", "local_sgd", "nnx", "precision",
             "random", "trainer", "verify"):
    getattr(jddp, name)  # import jddp imports each name on first use: here, once for all blocks
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.chdir(req["cwd"])
        for fd, path in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        warnings.filterwarnings("error", JDDP_DEPRECATION, DeprecationWarning)
        sys.argv = ["-c", req["code"]]
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(req["code"], "<doc block>", "exec"), main.__dict__)
        sys.exit(0)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class _Zygote:
    """One zygote process (per test module and xdist worker) and the lines it answers."""

    def __init__(self, log: pathlib.Path):
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, JDDP_DEPRECATION],
                                         cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, bufsize=0)
        self.buffer = b""

    def _line(self, deadline: float, what: str) -> str:
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(what)
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the doc block zygote ended (exit {self.proc.wait()}) while "
                                   f"waiting for {what}:\n{self.log.read_text()[-4000:]}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def run(self, block: Block, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
        out, err = cwd / "block.stdout", cwd / "block.stderr"
        request = {"code": block.code, "cwd": str(cwd), "out": str(out), "err": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        start = time.monotonic()
        pid = int(self._line(start + 60, f"the zygote to fork {block.id}"))
        try:
            rc = int(self._line(start + TIMEOUT_S, f"{block.id} to finish"))
        except TimeoutError:
            try:
                os.killpg(pid, signal.SIGKILL)  # the block and anything it started
            except ProcessLookupError:  # it ended meanwhile
                pass
            self._line(time.monotonic() + 30, f"the killed {block.id} to be reaped")
            pytest.fail(f"{block.id}: the block did not finish within {TIMEOUT_S} s")
        return subprocess.CompletedProcess([block.id], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = _Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.notest], ids=lambda b: b.id)
def test_block_runs(block, tmp_path, zygote):
    if block.path in PENDING:
        pytest.skip(f"{block.path} is not converted yet (PENDING in {pathlib.Path(__file__).name})")
    out = zygote.run(block, tmp_path)
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
