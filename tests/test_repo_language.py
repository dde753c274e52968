"""The repository speaks to its users: no trace of how the work was organised.

Every file git tracks (code, comments, docstrings, tests and their names, docs, recipes, benchmarks,
BENCHMARKS.md, this file too) is searched for references to tracker items and to numbered sessions or
rounds of work. History lives in git and, for users, in CHANGELOG.md.

Caught (case-insensitive), with examples in ``CAUGHT`` below: a tracker item's number (the word for an issue,
then an optional ``#`` or ``-``, then digits), the word for a tracker item itself, a numbered or ordinal
working session, a numbered round of work or review, and a pull-request number.

Allowed (``ALLOWED``): the engine's own session ("calibration session", "this session's passes": no number
or ordinal before it) and a modifier's search rounds ("each round scores every pair"; a numbered search
round is fine unless it is a round *of work*). The examples are assembled from their words by
``said`` so that this file passes the search it defines, like every other file.
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


def said(*words: str) -> str:
    return " ".join(words)


CAUGHT = [said("see", "issue", "11"), said("issue", "#12", "asks"), said("the", "issue" + "-3", "defaults"),
          said("(" + "tick" + "et" + ")"), said("Session", "10", "summary"), said("session", "9", "measured"),
          said("the", "fourth", "session"), said("round", "3", "of", "the", "work"), said("review", "round", "2"),
          said("PR", "#45")]
ALLOWED = ["the calibration session", "this session's passes", said("round", "2", "alone"),
           "each round scores every pair", "an issue with the tokenizer", said("round", "1,", "pruned:", "3.793"),
           "the sessions share one pass"]


@pytest.mark.parametrize("text, caught", [(text, True) for text in CAUGHT] + [(text, False) for text in ALLOWED])
def test_pattern_catches_work_words_and_allows_the_engines(text, caught):
    assert bool(WORK_WORDS.search(text)) is caught


def test_no_tracked_file_names_tracker_items_or_numbered_rounds_of_work():
    hits = []
    for path in tracked_files():
        if not path.is_file():
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
    assert not hits, (f"{len(hits)} lines name a tracker item or a numbered session/round of work:\n"
                      + "\n".join(hits[:60]))
