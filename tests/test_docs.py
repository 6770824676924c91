"""The README and the documentation site: the README opens with its two commands, its
library quickstart runs as written, and no page points outside the repository.

(`scripts/test.sh` builds the site with `mkdocs build --strict`, which fails on a
broken link, anchor or missing page inside `docs/`; these tests cover what it does not
see: the README, and files the site includes from elsewhere in the repository.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every Markdown file a reader of the repository or the site is pointed at.
PAGES = [README, ROOT / "ARCHITECTURE.md", ROOT / "deploy" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block, in order."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_opens_with_its_two_commands() -> None:
    """The first code block, under "Try it" on the first screen, is the demo then the test command."""
    text = README.read_text()
    lang, body = _blocks(text)[0]
    commands = [line.split("#")[0].strip() for line in body.splitlines()]
    assert (lang, commands) == ("bash", ["bash scripts/demo.sh", "bash scripts/test.sh"])
    assert text.index(body) > text.index("\n## Try it\n")
    assert text[: text.index(body)].count("\n") < 40
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_stays_short() -> None:
    """The README (the package's long description) is under 150 lines."""
    assert len(README.read_text().splitlines()) < 150


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page: Path) -> None:
    """Every relative link and image names a file of the repository; no design document elsewhere."""
    text = page.read_text()
    assert "DESIGN.md" not in text and "../shared" not in text
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"


@pytest.mark.timeout(120)
def test_the_readme_library_quickstart_runs_as_written(tmp_path: Path) -> None:
    """The README's library quickstart, run as a script, prints storage then peer."""
    lang, body = _blocks(_section(README.read_text(), "Quickstart: the library"))[0]
    # Its model directory moves into the test's own folder: parallel runs never share it.
    assert lang == "python" and '"/tmp/tiny' in body
    script = tmp_path / "quickstart.py"
    script.write_text(body.replace("/tmp/tiny", str(tmp_path / "tiny")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["storage", "peer"], proc.stdout + proc.stderr
