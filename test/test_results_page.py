"""``benchmark/RESULTS.md`` and ``benchmark/results/`` agree: every result file is named on the page, every result
path the page names exists, the page stays a results page (at most 400 lines) and its headings carry no commit ids.

Why: the page is where a reader finds what each file under ``benchmark/results/`` measured and how; a file nobody
names is an orphan, and a name with no file is a broken promise. No server, no model: reads two trees of text.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "benchmark" / "RESULTS.md"
RESULTS = ROOT / "benchmark" / "results"
MAX_LINES = 400

# A result path as the page writes it: ``benchmark/results/NAME`` or, relative to the page, ``results/NAME``.
RESULT_PATH = re.compile(r"(?<![\w/-])(?:benchmark/)?results/([\w.\-/]*\w)")
# A commit-id-looking token: 7-40 hex characters with at least one digit and one letter a-f.
HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z])[0-9a-fA-F]{7,40}(?![0-9A-Za-z])")


def named_paths(text: str) -> set[str]:
    """Paths under ``benchmark/results/`` the text names, relative to that folder."""
    return {m.group(1) for m in RESULT_PATH.finditer(text)}


def result_files(folder: Path) -> set[str]:
    """Every file under ``folder``, recursively, relative to it."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def headings(text: str) -> list[str]:
    """Markdown headings outside fenced code blocks (a ``#`` comment in a shell block is not a heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line)
    return out


def commit_like(text: str) -> list[str]:
    return [t for t in HEX_TOKEN.findall(text) if re.search(r"\d", t) and re.search(r"[a-fA-F]", t)]


def unnamed_files(page: str, folder: Path) -> set[str]:
    return result_files(folder) - named_paths(page)


def missing_files(page: str, folder: Path) -> set[str]:
    return {name for name in named_paths(page) if not (folder / name).exists()}


def test_every_result_file_is_named_on_the_page() -> None:
    assert RESULTS.is_dir()
    unnamed = sorted(unnamed_files(PAGE.read_text(), RESULTS))
    assert not unnamed, f"files under benchmark/results/ that RESULTS.md never names: {unnamed}"


def test_every_result_path_on_the_page_exists() -> None:
    assert named_paths(PAGE.read_text()), "RESULTS.md names no result files at all"
    missing = sorted(missing_files(PAGE.read_text(), RESULTS))
    assert not missing, f"paths RESULTS.md names under benchmark/results/ that do not exist: {missing}"


def test_page_is_at_most_400_lines() -> None:
    lines = len(PAGE.read_text().splitlines())
    assert lines <= MAX_LINES, f"RESULTS.md has {lines} lines (at most {MAX_LINES}): history belongs in git"


def test_headings_carry_no_commit_ids() -> None:
    bad = {h: commit_like(h) for h in headings(PAGE.read_text()) if commit_like(h)}
    assert not bad, bad


def test_the_checks_catch_violations(tmp_path: Path) -> None:
    """Controls: each check fails on a page and folder built to violate it."""
    folder = tmp_path / "results"
    (folder / "sub").mkdir(parents=True)
    (folder / "kept.jsonl").write_text("{}\n")
    (folder / "sub" / "stray.png").write_bytes(b"")
    page = "Records: `benchmark/results/kept.jsonl`, plot ![x](results/gone.png).\n"
    assert unnamed_files(page, folder) == {"sub/stray.png"}
    assert missing_files(page, folder) == {"gone.png"}
    assert named_paths("see benchmark/results/kept.jsonl.") == {"kept.jsonl"}
    assert named_paths("other_results/x.jsonl") == set()
    assert commit_like("### Again at 3d7c2bc, 9 runs") == ["3d7c2bc"]
    assert commit_like("### 1000000 tokens, deadbeef, 129280") == []
    assert headings("```bash\n# a1b2c3d4 comment\n```\n## Results\n") == ["## Results"]
