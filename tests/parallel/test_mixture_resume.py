"""A weighted mixture resumed on another layout: 2 gloo ranks checkpoint, one process continues (issue 25 §3).

The 2-rank run (dp_shard=2) trains 6 steps on two sources mixed 3:1, saving after step 3; one process resumed from
that checkpoint must see exactly the samples the 2-rank run saw in steps 4-6, so its losses equal the source's
within the parity tolerance of another reduction order (a different sample would move the loss far more).
"""

import json

import pytest

from tests.parallel.test_checkpoint import launch, resumable, train_losses
from training.metrics import read_metrics


def test_a_mixture_resumed_from_two_ranks_on_one_process_continues_the_same_samples(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.txt").write_bytes(bytes(range(32, 127)) * 60)
    with open(tmp_path / "chat.jsonl", "w") as out:
        for i in range(80):
            out.write(json.dumps({"text": f"record {i}: " + "lorem ipsum dolor " * 4}) + "\n")
    mixture = [f"data.sources=[{{path: {tmp_path / 'code'}, weight: 3}}, {{path: {tmp_path / 'chat.jsonl'}}}]",
               f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2"]
    source = tmp_path / "two-ranks"
    launch([*mixture, "parallel.dp_shard=2"], 2, {"run_dir": str(source)})
    run_dir = resumable(source, 3, tmp_path / "one-process")
    launch(mixture, 1, {"run_dir": str(run_dir)})
    want, got = train_losses(source), train_losses(run_dir)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    # per-source losses summed over both ranks' rows: 6 of each 8 samples from code, 2 from chat
    for record in (r for r in read_metrics(source / "metrics.jsonl") if "train/loss" in r):
        whole = 0.75 * record["train/loss/code"] + 0.25 * record["train/loss/chat.jsonl"]
        assert whole == pytest.approx(record["train/loss"], rel=1e-5)
