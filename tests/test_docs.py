"""Every Python block of the documentation runs on its own, as if pasted into a fresh
interpreter, and the site builds in strict mode.

Each block runs alone in a child process started in the repository root: blocks do
not share names, so each makes its own imports, configuration and definitions. A
block that cannot run here (e.g. one that needs several hosts) is marked by an HTML
comment on the line before its fence,

    <!-- not run: needs several hosts -->

and is then only compiled; each such block is reported as a skipped test with its
reason. A block made only of snippet lines that include files under `examples/`
(`--8<-- "examples/neural_ode.py"`) shows an example that `test_examples.py` runs;
the test checks that it does. The README's examples are run by `test_readme.py`.
"""

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from .helpers import run_fresh


ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
_SNIPPET = re.compile(r'^\s*-+8<-+\s+"(?P<path>[^"]+)"\s*$')
_TIMEOUT = 300  # seconds, for a block that takes a few


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    source: str
    not_run: str | None  # the reason, for a block marked `<!-- not run: ... -->`

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def included_examples(self) -> list[str] | None:
        """The files a block of snippet lines includes, or `None` for code."""
        lines = [line for line in self.source.splitlines() if line.strip()]
        matches = [_SNIPPET.match(line) for line in lines]
        if not lines or not all(matches):
            return None
        return [m["path"] for m in matches]


def python_blocks(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of `page` whose language is `python` (or `py`)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        info = m["info"].strip().lstrip("{").strip().lstrip(".")
        language = re.split(r"[\s.}]", info, maxsplit=1)[0] if info else ""
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence)
            and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i])
            i += 1
        i += 1
        if language not in ("python", "py"):
            continue
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _NOT_RUN.match(lines[before]) if before >= 0 else None
        source = textwrap.dedent("\n".join(body)) if indent else "\n".join(body)
        blocks.append(
            Block(page, start + 1, source, marker["reason"] if marker else None)
        )
    return blocks


def _runs(block: Block) -> bool:
    return block.not_run is None and block.included_examples is None


def _runnable_blocks():
    return [b for p in PAGES for b in python_blocks(p) if _runs(b)]


def _not_run_blocks():
    return [b for p in PAGES for b in python_blocks(p) if b.not_run is not None]


def test_the_docs_have_python_examples():
    assert PAGES, f"no pages under {DOCS}"
    assert len({b.page for b in _runnable_blocks()}) >= 5


def _block_params():
    """The runnable blocks; the guides' (a fresh interpreter and a few compiled
    solves each, 5-10 s) are long tests, the other pages' run by default."""
    return [
        pytest.param(
            block,
            id=f"{block.page.relative_to(DOCS)}:{block.line}",
            marks=pytest.mark.slow if "guides" in block.page.parts else (),
        )
        for block in _runnable_blocks()
    ]


@pytest.mark.parametrize("block", _block_params())
def test_block_runs(block):
    # Tracebacks name the page, at its own line numbers.
    try:
        done = run_fresh(
            block.source,
            ROOT,
            filename=str(block.page),
            first_line=block.line + 1,
            timeout=_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Python block at {block.name} ran past {_TIMEOUT} s")
    assert done.returncode == 0, (
        f"the Python block at {block.name} failed on its own:\n{done.stderr[-4000:]}"
    )


def test_blocks_marked_not_run():
    blocks = _not_run_blocks()
    for block in blocks:
        compile(block.source, block.name, "exec")  # not run, but valid Python
    total = sum(len(python_blocks(p)) for p in PAGES)
    assert len(blocks) <= max(2, total // 10), "blocks marked not run must stay rare"
    if blocks:
        pytest.skip(
            f"{len(blocks)} of {total} blocks are marked not run: "
            + "; ".join(f"{b.name} ({b.not_run})" for b in blocks)
        )


def test_included_examples_are_tested():
    tested = (ROOT / "tests" / "test_examples.py").read_text()
    for page in PAGES:
        for block in python_blocks(page):
            for path in block.included_examples or []:
                file = ROOT / path
                assert file.parent == ROOT / "examples" and file.exists(), block.name
                assert re.search(rf"^import {file.stem}\b", tested, re.M), (
                    f"{block.name} shows {path}, which tests/test_examples.py does not "
                    "run"
                )


def test_every_public_name_has_an_api_entry():
    public = set(
        re.findall(r"\b(\w+) as \1\b", (ROOT / "gradsolve" / "__init__.py").read_text())
    )
    api = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^::: gradsolve\.(\w+)", api, re.M))
    documented |= set(re.findall(r"\{ #gradsolve\.(\w+) \}", api))
    assert public, "no re-exports found in gradsolve/__init__.py"
    assert public <= documented, f"no API entry for {sorted(public - documented)}"


def _missing_docs_tools():
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def test_mkdocs_build_strict(tmp_path):
    missing = _missing_docs_tools()
    if missing is not None:
        pytest.skip(f'{missing} is not installed (pip install ".[docs]")')
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stderr}"
    assert (tmp_path / "index.html").exists()
    for png in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert (tmp_path / "benchmarks" / "results" / png.name).exists(), png.name
