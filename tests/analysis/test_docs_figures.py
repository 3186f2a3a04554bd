"""The dry-run figure that docs/planning.md and docs/parallelism.md both give for the planner's first Mixtral
plan is the one its printed command dry-runs to (the full-size model on the meta device: a few seconds)."""

import re
import shlex
from pathlib import Path

import train

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_both_pages_give_the_dry_run_of_the_printed_command(capsys):
    planning = (DOCS / "planning.md").read_text()
    block = re.search(r"so the first is\n\n```bash\n(torchrun .*?)\n```", planning, re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    assert train.main([*words[words.index("train.py") + 1:], "--dry-run", "--world-size", "64"]) == 0
    figure = re.search(r"predicted step total, ([\d.]+) GiB", capsys.readouterr().out).group(1)
    said = re.search(r"predicted step total,\s+([\d.]+) GiB", planning).group(1)
    parallelism = " ".join((DOCS / "parallelism.md").read_text().split())
    assert re.search(r"the planner's first plan, .*? dry-runs to ([\d.]+) GiB", parallelism).group(1) == figure
    assert said == figure
