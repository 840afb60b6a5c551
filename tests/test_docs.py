"""The examples of README.md and docs/*.md run as written, on the CPU.

Every ```python block is collected. The blocks of one page run in order in
one shared namespace (as a script would, `__name__ == "__main__"`), so a
page builds an engine once and its later blocks use it; each block is its
own test, named `page:line`. Blocks in other languages are not run.

A block that cannot run everywhere says so on the line right before its
fence (docs/index.md, "About the examples"):

    <!-- gpu: needs CUDA -->           a `gpu` test: skipped without CUDA; runs alone,
                                       in a namespace of its own (self-contained)
    <!-- slow: about a minute -->      a `slow` test: run after the fast ones (.ci/run)
    <!-- skip: serves until stopped --> never run; reported as skipped with the reason

Later blocks of a page must not need what a gpu, slow or skipped block
defines. At the end of a page, every engine, pool or server process its
namespace still holds is shut down.

Relative links of the pages must point at files that exist (and headings
that exist, for `#anchors`)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!--\s*(skip|slow|gpu):\s*(.+?)\s*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    code: str
    mark: tuple[str, str] | None  # ("skip" | "slow" | "gpu", reason)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _dedent(line: str, indent: int) -> str:
    """A line of a block fenced at `indent` columns (inside a list item)."""
    return line[indent:] if line[:indent].strip() == "" else line.lstrip()


def blocks_of(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of one page, with the mark on the line before each."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang in ("python", "py"):
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(before)
            code = "\n".join(_dedent(line, indent) for line in lines[i + 1:end])
            found.append(Block(str(path.relative_to(ROOT)), i + 2, code,
                               (mark.group(1), mark.group(2)) if mark else None))
        i = end + 1
    return found


ALL_BLOCKS = [b for p in pages() for b in blocks_of(p)]


def _kind(block: Block) -> str | None:
    return block.mark[0] if block.mark else None


def _param(block: Block):
    marks = {"slow": [pytest.mark.slow], "gpu": [pytest.mark.gpu]}.get(_kind(block), [])
    return pytest.param(block, marks=marks, id=block.id)


@dataclass
class PageRun:
    """One page's namespace and how far it has run."""
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    done: int = 0  # blocks of the page run (or passed over) so far
    failed: str | None = None  # the id of a block that failed


RUNS: dict[str, PageRun] = {}


def _shutdown(run: PageRun) -> None:
    """Engines, pools and servers the page left running are shut down."""
    for value in list(run.namespace.values()):
        if isinstance(value, subprocess.Popen) and value.poll() is None:
            value.kill()
            value.wait()
        elif type(value).__module__.startswith("rollout_engine") and callable(getattr(value, "shutdown", None)):
            try:
                value.shutdown()
            except Exception:  # noqa: BLE001 - the page's own result is what the test reports
                pass
    run.namespace.clear()


@pytest.fixture(scope="module", autouse=True)
def _pages_end():
    yield
    for run in RUNS.values():
        _shutdown(run)


def _execute(block: Block, run: PageRun, workdir: pathlib.Path) -> None:
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        # Line numbers in a traceback are the page's own.
        exec(compile("\n" * (block.line - 1) + block.code, str(ROOT / block.page), "exec"), run.namespace)
    except BaseException as e:  # noqa: BLE001 - reported with the page and line
        if isinstance(e, KeyboardInterrupt):
            raise
        run.failed = block.id
        detail = "".join(traceback.format_exception(e)[-12:])
        pytest.fail(f"{block.page}: the block at line {block.line} failed:\n{detail}", pytrace=False)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("block", [_param(b) for b in ALL_BLOCKS])
def test_example(block: Block, tmp_path_factory):
    workdir = tmp_path_factory.getbasetemp() / ("docs-" + re.sub(r"\W", "-", block.page))
    workdir.mkdir(exist_ok=True)
    if _kind(block) == "skip":
        pytest.skip(block.mark[1])
    if _kind(block) == "gpu":  # self-contained, in a namespace of its own
        alone = PageRun()
        try:
            _execute(block, alone, workdir)
        finally:
            _shutdown(alone)
        return
    run = RUNS.setdefault(block.page, PageRun())
    page_blocks = [b for b in ALL_BLOCKS if b.page == block.page]
    index = page_blocks.index(block)
    try:
        # Selected alone (-k): the page's earlier blocks run first (slow ones
        # only for a slow block).
        for earlier in page_blocks[run.done:index]:
            if run.failed is None and (_kind(earlier) is None or _kind(earlier) == _kind(block) == "slow"):
                _execute(earlier, run, workdir)
        run.done = max(run.done, index)
        if run.failed is not None:
            pytest.skip(f"an earlier block of {block.page} failed ({run.failed})")
        _execute(block, run, workdir)
    finally:
        run.done = max(run.done, index + 1)
        if index == len(page_blocks) - 1:
            _shutdown(run)


def test_every_page_has_examples_collected():
    assert any(b.page == "README.md" for b in ALL_BLOCKS)
    marked = [b for b in ALL_BLOCKS if b.mark]
    assert all(b.mark[1] for b in marked), "a mark names its reason"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: pathlib.Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
