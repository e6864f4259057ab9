"""The product speaks of itself: no tracked file (code, docstrings, comments, tests, docs,
result files) names how the work on it was organised: numbered work stops or rounds, issue
numbers, which run of which round was recorded, session diaries."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile("|".join((
    r"\bstop[ -]\d+'s\b",  # "stop 45's runs"
    r"(?:\(|\b(?:since|until|in|of|before|after|from|at|by|than)\s)stop[ -]\d+\b",  # "(stop 48)", "since stop 52"
    r"\bstop-\d+\b",
    r"\bissue\s+#?\d+\b",  # "(issue 17)", "issue 16:"
    r"\brun \d+/\d+\b",  # "run 52/3"
    r"\bround \d+\b",  # a numbered work round
    r"\b(?:lab|session|work) diary\b",
)), re.IGNORECASE)
SKIP_SUFFIXES = {".png", ".jpg", ".gguf", ".safetensors", ".bin", ".pt", ".ico"}
SKIP_NAMES = {"tokenizer.json", Path(__file__).name}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in filter(None, out.decode().split("\0")):
        path = ROOT / name
        if path.suffix in SKIP_SUFFIXES or path.name in SKIP_NAMES or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" not in head:  # not a binary asset
            files.append(path)
    return files


def test_the_patterns_catch_work_history_and_not_the_domain() -> None:
    for text in ("stop 45's runs measured 80 ms", "(stop 48)", "since stop 52", "(issue 17)", "Issue 16: answers",
                 "run 52/3", "in round 4 of the work", "the lab diary"):
        assert HISTORY.search(text), text
    for text in ("stop 2 workers", "stop strings", "the decode worker's issue", "8 interleaved rounds",
                 "rounds 1-8 of the calibration's timing", "a run of 52 requests", "round_robin 0.27"):
        assert not HISTORY.search(text), text


def test_no_tracked_file_refers_to_how_the_work_was_done() -> None:
    files = _tracked_text_files()
    assert len(files) > 100  # the whole tree, not a corner of it
    hits = []
    for path in files:
        text = path.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if m := HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "work-history references (say what the code does, not how it was worked on):\n" + "\n".join(
        hits[:50])
