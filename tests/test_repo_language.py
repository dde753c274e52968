"""The repository speaks to its users: no trace of how the work was organised.

Every file git tracks (code, comments, docstrings, tests and their names, docs, recipes, benchmarks,
BENCHMARKS.md) is searched for references to tickets and to numbered sessions or rounds of work. History
lives in git and, for users, in CHANGELOG.md.

Caught (case-insensitive)::

    issue 11, issue #12, issue-3, issues 11        a ticket number
    ticket, tickets                                 the word itself
    session 9, Session 10 summary, session #4       a numbered working session
    second session, last session                    an ordinal working session
    round 3 of the work, review round 2             a numbered round of work
    PR #123                                         a pull request number

Allowed: the engine's own session ("calibration session", "the reference session", "this session's
passes": no number or ordinal before it) and a modifier's search rounds ("round 2 alone", "each round
scores every pair", "rounds are shared as a prefix": a round number is fine unless it is a round *of work*).
This file itself is the only one not searched, since it has to spell out what it catches.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORK_WORDS = re.compile(r"""
    \bissues?[ \t-]?\#?\d+
  | \btickets?\b
  | \bsessions?[ \t]?\#?\d+
  | \b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|previous|earlier|next|last)[ \t]+session\b
  | \brounds?[ \t]+\d+[ \t]+of[ \t]+(?:the[ \t]+)?(?:work|review|development|issue|this)\b
  | \b(?:work|review|development)[ \t]+rounds?[ \t]+\d+
  | \bPR[ \t]?\#\d+
""", re.I | re.X)


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return [ROOT / name for name in listed.decode().split("\0") if name]


@pytest.mark.parametrize("text, caught", [
    ("see issue 11", True), ("issue #12 asks", True), ("the issue-3 defaults", True), ("(ticket)", True),
    ("Session 10 summary", True), ("session 9 measured", True), ("the fourth session", True),
    ("round 3 of the work", True), ("review round 2", True), ("PR #45", True),
    ("the calibration session", False), ("this session's passes", False), ("round 2 alone", False),
    ("each round scores every pair", False), ("an issue with the tokenizer", False),
    ("round 1, pruned: 3.793", False), ("the sessions share one pass", False),
])
def test_pattern_catches_work_words_and_allows_the_engines(text, caught):
    assert bool(WORK_WORDS.search(text)) is caught


def test_no_tracked_file_names_tickets_or_numbered_rounds_of_work():
    hits = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images)
        relative = path.relative_to(ROOT).as_posix()
        hits += [f"{relative}:{number}: {line.strip()[:120]}" for number, line in enumerate(text.splitlines(), 1)
                 if WORK_WORDS.search(line)]
        if WORK_WORDS.search(relative):
            hits.append(f"{relative}: file name")
    assert not hits, f"{len(hits)} lines name a ticket or a numbered session/round of work:\n" + "\n".join(hits[:60])
