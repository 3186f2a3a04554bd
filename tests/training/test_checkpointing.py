"""Checkpoints in one process: exact resume, data continuity, corruption fallback, safe loading, the NaN guard.

Runs use the parity harness's tiny model (``tests/parallel/parity.py``); a run is "stopped" by raising out of
the training loop right after a step, exactly where a crash would leave it.
"""

import json
import pickle
import shutil

import pytest
import safetensors
import safetensors.torch
import torch
import yaml

import training.loop
import training.step
from config.errors import ConfigError
from config.run import load_config
from data.sampler import TokenSampler
from interop import export
from interop.weights import initial_weights
from moe.transformer import MoETransformer
from parallel.checkpoint import (
    CheckpointCorruptError,
    SafeFileSystemReader,
    load_sharded,
    published_checkpoints,
    verify,
    write_manifest,
)
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import Runtime
from tests.parallel.parity import TINY, run
from tests.training.stopped_run import stopped_after_step
from training.checkpointing import Checkpointer
from training.metrics import read_metrics
from training.optim import build_optimizer

STEPS = 6
SETTINGS = [f"train.steps={STEPS}", "checkpoint.interval=3", "moe.capacity_factor=1.25", "moe.bias_update_rate=0.01"]


def record_batches(monkeypatch) -> list[torch.Tensor]:
    """Every batch the sampler hands out, in order."""
    seen, original = [], TokenSampler.next_batch

    def next_batch(self, size):
        inputs, targets = original(self, size)
        seen.append(inputs.clone())
        return inputs, targets

    monkeypatch.setattr(TokenSampler, "next_batch", next_batch)
    return seen


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 6 steps in one go, checkpoints after steps 3 and 6."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        batches = record_batches(monkeypatch)
        run_dir = tmp_path_factory.mktemp("uninterrupted")
        records, state = run(SETTINGS, 1, run_dir)
    return records, state, batches, run_dir


def losses(records):
    return [(r["step"], r["train/loss"], r["train/grad_norm"], r["train/aux_loss"]) for r in records]


def test_stopped_and_resumed_run_is_bit_identical(uninterrupted, tmp_path, monkeypatch):
    ref_records, ref_state, ref_batches, _ = uninterrupted
    batches = record_batches(monkeypatch)
    with stopped_after_step(monkeypatch, 4):
        run(SETTINGS, 1, tmp_path)
    assert [s for s, _ in published_checkpoints(tmp_path / "checkpoints")] == [3]
    first_attempt = len(batches)
    records, state = run(SETTINGS, 1, tmp_path)  # the same command again: resumes from step 3

    assert first_attempt == 4
    assert losses(records) == losses(ref_records)  # bit for bit, the log rewound to the checkpoint
    # the data: steps 1-3 of the first attempt, then 4-6 of the second; step 4's batch is seen again, none skipped
    replayed = batches[:3] + batches[first_attempt:]
    assert len(replayed) == len(ref_batches) == STEPS
    for got, want in zip(replayed, ref_batches, strict=True):
        assert torch.equal(got, want)
    assert state.keys() == ref_state.keys()
    for name in ref_state:  # weights and the balancing biases (buffers)
        assert torch.equal(state[name], ref_state[name]), name
    assert any("expert_bias" in name and state[name].abs().sum() > 0 for name in state)


def single_process(overrides):
    config = load_config("moe-8x", [*TINY, *overrides])
    model = MoETransformer(config.model, config.moe)
    return config, model, build_optimizer(model, config.train)


def load_checkpoint(path, overrides=SETTINGS):
    """A fresh single-process model and optimizer loaded from ``path``."""
    _, model, optimizer = single_process(overrides)
    load_sharded(model, optimizer, path)
    return model, optimizer


def test_checkpoint_holds_the_trained_state(uninterrupted):
    _, ref_state, _, run_dir = uninterrupted
    path = run_dir / "checkpoints" / "step_0000006"
    model, optimizer = load_checkpoint(path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    steps = {float(s["step"]) for s in optimizer.state.values()}
    assert steps == {6.0}  # Adam's step count travelled with its moments
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 8 * 32
    assert state["sampler"]["samples_seen"] == 6 * 8 and state["skipped_steps"] == 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    assert set(json.loads((path / "manifest.json").read_text())["files"]) >= {
        "trainer_state.json", "config.yaml", "rng/rank_00000.pt", ".metadata"}


def test_damaged_checkpoint_is_reported_and_the_previous_one_used(uninterrupted, tmp_path, capsys):
    _, _, _, ref_dir = uninterrupted
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "checkpoints")
    shard = next((tmp_path / "checkpoints" / "step_0000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))

    config, model, optimizer = single_process(SETTINGS)
    sampler = TokenSampler(torch.zeros(10_000, dtype=torch.int64).numpy(), config.model.seq_len, 0)
    groups = ParallelGroups.build(Layout.resolve(1), "cpu")
    checkpointer = Checkpointer(config, tmp_path, Runtime(0, 1, 0, torch.device("cpu")), groups)
    assert checkpointer.restore(model, optimizer, sampler) == 3
    err = capsys.readouterr().err
    assert shard.name in err and "SHA-256" in err and "step_0000006" in err

    (tmp_path / "checkpoints" / "step_0000003" / "manifest.json").write_text('{"files": {}, "digest": "x"}')
    with pytest.raises(CheckpointCorruptError, match="no complete checkpoint"):
        Checkpointer(config, tmp_path, Runtime(0, 1, 0, torch.device("cpu")), groups).restore(model, optimizer, sampler)
    with pytest.raises(ConfigError, match="--resume none"):  # never silently overwrites a run
        Checkpointer(config, tmp_path, Runtime(0, 1, 0, torch.device("cpu")), groups, resume="none").restore(
            model, optimizer, sampler)


def test_verify_names_truncated_and_missing_files(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 10)
    write_manifest(tmp_path)
    verify(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"x" * 99)
    with pytest.raises(CheckpointCorruptError, match=r"a\.bin: 99 bytes, the manifest says 100"):
        verify(tmp_path)
    (tmp_path / "sub" / "b.bin").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"b\.bin: listed in the manifest but missing"):
        verify(tmp_path, rank=1, world_size=2)  # rank 1's share is the second file
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["files"]["a.bin"]["bytes"] = 99  # an edited manifest no longer matches its digest
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="digest"):
        verify(tmp_path)


class _Exploit:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def test_metadata_loading_runs_no_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.exec"):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not (tmp_path / "PWNED").exists()


def test_non_finite_steps_are_skipped_then_the_run_stops_naming_the_last_good_state(tmp_path, monkeypatch, capsys):
    calls = {"n": 0}
    real_loss = training.step.lm_loss

    def poisoned(logits, targets):  # from the third step on, the loss is NaN
        calls["n"] += 1
        loss = real_loss(logits, targets)
        return loss * float("nan") if calls["n"] > 2 else loss

    monkeypatch.setattr(training.step, "lm_loss", poisoned)
    settings = ["train.steps=8", "checkpoint.interval=1", "train.max_bad_steps=3", "train.eval_batches=1"]
    with pytest.raises(training.loop.NonFiniteLossError, match="3 non-finite steps in a row") as error:
        run(settings, 1, tmp_path)
    assert "step_0000001" in str(error.value) and "lower train.lr" in str(error.value)
    # step 2's state gave step 3's NaN: its save was discarded; the skipped steps 3-5 took no saves
    checkpoints = tmp_path / "checkpoints"
    assert [s for s, _ in published_checkpoints(checkpoints)] == [1]
    assert not list(checkpoints.glob(".tmp_*"))
    assert "checkpoint step_0000002 discarded" in capsys.readouterr().err
    state = json.loads((checkpoints / "step_0000001" / "trainer_state.json").read_text())
    assert state["reason"] == "interval" and state["skipped_steps"] == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in records if r["step"] == 3 and "train/loss" in r] == ["nan"]


def test_auto_interval_saves_first_to_measure_then_logs_its_choice(tmp_path, capsys):
    # M = 0.36 ms: every save takes longer than 2M, so Daly's interval is M itself and each step is saved
    run(["train.steps=3", "checkpoint.interval=auto", "checkpoint.mtbf_hours=1e-7", "checkpoint.keep=2",
         "train.eval_batches=1"], 1, tmp_path)
    err = capsys.readouterr().err
    assert "checkpoint step_0000001" in err and "expected work lost per failure" in err and "(Daly; Young" in err
    assert [s for s, _ in published_checkpoints(tmp_path / "checkpoints")] == [3, 2]  # keep=2 pruned step 1
    saves = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "checkpoint/save_s" in r]
    assert [r["step"] for r in saves] == [1, 2, 3] and all(r["checkpoint/bytes"] > 0 for r in saves)


def test_async_save_writes_the_state_of_its_step_while_training_goes_on(uninterrupted, tmp_path, capsys):
    ref_records, _, _, ref_dir = uninterrupted
    records, _ = run([*SETTINGS, "checkpoint.async_save=true"], 1, tmp_path)
    assert losses(records) == losses(ref_records)
    assert "training blocked" in capsys.readouterr().err
    for name in ("step_0000003", "step_0000006"):  # step 3 was written while steps 4 and 5 trained
        want, want_optimizer = load_checkpoint(ref_dir / "checkpoints" / name)
        got, got_optimizer = load_checkpoint(tmp_path / "checkpoints" / name)
        for key, value in want.state_dict().items():
            assert torch.equal(got.state_dict()[key], value), (name, key)
        for want_state, got_state in zip(want_optimizer.state.values(), got_optimizer.state.values(), strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got_state[key], want_state[key]), (name, key)


def test_hyperparameters_may_change_on_resume_and_the_change_is_recorded(uninterrupted, tmp_path, capsys):
    _, _, _, ref_dir = uninterrupted
    shutil.copytree(ref_dir / "checkpoints" / "step_0000003", tmp_path / "checkpoints" / "step_0000003")
    changed = ["train.lr=5e-3", "moe.capacity_factor=2.0", "train.global_batch_size=16", "moe.aux_loss_coef=0.02"]
    records, _ = run([*SETTINGS, *changed, "train.eval_batches=1"], 1, tmp_path)
    assert [r["step"] for r in records] == [4, 5, 6]
    entries = yaml.safe_load((tmp_path / "resume_changes.yaml").read_text())
    assert len(entries) == 1 and entries[0]["step"] == 3
    assert entries[0]["changes"]["train.lr"] == {"saved": 0.01, "now": 0.005}
    assert entries[0]["changes"]["moe.capacity_factor"] == {"saved": 1.25, "now": 2.0}
    assert entries[0]["changes"]["train.global_batch_size"] == {"saved": 8, "now": 16}
    assert set(entries[0]["changes"]) == {"train.lr", "moe.capacity_factor", "train.global_batch_size",
                                          "moe.aux_loss_coef", "train.eval_batches"}
    assert "resume: train.lr changed from 0.01 to 0.005" in capsys.readouterr().err
    state = json.loads((tmp_path / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    # 3 steps of 8 sequences, then 3 of 16: the sampler continued where it stopped
    assert state["sampler"]["samples_seen"] == 3 * 8 + 3 * 16
    assert state["tokens_seen"] == (3 * 8 + 3 * 16) * 32


def test_export_to_safetensors_and_start_a_run_from_it(uninterrupted, tmp_path, capsys):
    _, ref_state, _, ref_dir = uninterrupted
    out = tmp_path / "model.safetensors"
    assert export.main([str(ref_dir / "checkpoints"), str(out)]) == 0  # the folder: its newest checkpoint
    weights = safetensors.torch.load_file(out)
    assert weights.keys() == ref_state.keys()
    for name, value in ref_state.items():
        assert torch.equal(weights[name], value), name
    with safetensors.safe_open(out, framework="pt") as handle:
        assert yaml.safe_load(handle.metadata()["config.yaml"])["train"]["steps"] == STEPS

    config, model, optimizer = single_process(SETTINGS)
    sampler = TokenSampler(torch.zeros(10_000, dtype=torch.int64).numpy(), config.model.seq_len, 0)
    groups = ParallelGroups.build(Layout.resolve(1), "cpu")
    checkpointer = Checkpointer(config, tmp_path / "run", Runtime(0, 1, 0, torch.device("cpu")), groups,
                                init_weights=initial_weights(str(out), config))
    assert checkpointer.restore(model, optimizer, sampler) == 0  # a new run, step 0, fresh optimizer
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    assert not optimizer.state and "initialised from" in capsys.readouterr().err
    other = load_config("moe-8x", [*TINY, "model.d_model=64"])
    bad = Checkpointer(other, tmp_path / "r2", Runtime(0, 1, 0, torch.device("cpu")), groups,
                       init_weights=initial_weights(str(out), other))
    _, other, other_optimizer = single_process([*SETTINGS, "model.d_model=64"])
    first_differing = r"tensor .tok_embeddings.weight. has shape \(256, 32\), this model needs \(256, 64\)"
    with pytest.raises(ConfigError, match=first_differing):
        bad.restore(other, other_optimizer, sampler)


def test_wall_clock_interval(tmp_path, monkeypatch):
    config = load_config("moe-8x", [*TINY, "checkpoint.interval=null", "checkpoint.interval_minutes=2"])
    groups = ParallelGroups.build(Layout.resolve(1), "cpu")
    clock = {"now": 1000.0}
    monkeypatch.setattr("training.checkpointing.time.monotonic", lambda: clock["now"])
    checkpointer = Checkpointer(config, tmp_path, Runtime(0, 1, 0, torch.device("cpu")), groups)
    clock["now"] += 119
    assert not checkpointer._due(7)
    clock["now"] += 1
    assert checkpointer._due(8)
