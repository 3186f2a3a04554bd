"""``moe-generate``/``moe-evaluate`` inputs: an ``hf:DIR`` model runs at the folder's context length (not the
default config's 256); ``moe-evaluate --source`` errors advise its own flags (``--text-key``, ``--skip``,
``--token-dtype``), which it takes; a run directory's damaged ``config.yaml`` is one message, not a traceback; and
a checkpoint a running job prunes while it is read is said to have gone, not to be damaged."""

import shutil

import numpy as np
import pytest

import parallel.checkpoint
from config.errors import UserError
from inference import load_model
from inference.evaluate import main as evaluate_main
from inference.generate import main as generate_main
from tests.interop.test_hf import make_hf

pytest.importorskip("transformers")


def one_error(capsys, message):
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_an_hf_folder_runs_at_its_own_context_length(tmp_path):
    for positions in (64, 512):  # below the default config's 256 (was refused), and above it (was cut to 256)
        make_hf(tmp_path / f"hf{positions}", max_position_embeddings=positions)
        loaded = load_model(f"hf:{tmp_path / f'hf{positions}'}")
        assert loaded.config.model.seq_len == loaded.model.rope_cos.shape[0] == positions
    assert load_model(f"hf:{tmp_path / 'hf512'}", seq_len=32).config.model.seq_len == 32  # asked for: as asked


def test_evaluate_source_errors_advise_the_flags_it_takes(trained_run, tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text('{"body": "some held-out text, long enough to predict"}\n' * 20)
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "records.jsonl"),
                          "--cache-dir", str(tmp_path / "cache")]) == 2
    one_error(capsys, "no 'text' field (its fields: 'body'); set --text-key to the field that holds the text")
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "records.jsonl"), "--text-key", "body",
                          "--cache-dir", str(tmp_path / "cache")]) == 0
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    capsys.readouterr()
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "ids.bin")]) == 2
    one_error(capsys, "but --token-dtype=None; state the dtype its ids were written in")
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "ids.bin"), "--token-dtype", "uint16",
                          "--cache-dir", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("plain text to evaluate on " * 10)
    (tmp_path / "folder" / "b.zip").write_bytes(b"PK\x03\x04")
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "folder")]) == 2
    assert "data." not in one_error(capsys, "leave them out with --skip")
    assert evaluate_main([str(trained_run), "--source", str(tmp_path / "folder"), "--skip", "*.zip",
                          "--cache-dir", str(tmp_path / "cache")]) == 0


@pytest.mark.parametrize("text", ["model: [unclosed\n", "- 1\n", "checkpoint: {dir: [1]}\n", "\xff\xfe"])
def test_a_damaged_config_yaml_of_a_run_directory_is_one_message(trained_run, tmp_path, capsys, text):
    garbled = tmp_path / "run"
    shutil.copytree(trained_run, garbled)
    (garbled / "config.yaml").write_bytes(text.encode("latin-1"))
    assert generate_main([str(garbled), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    one_error(capsys, f"{garbled / 'config.yaml'} is damaged (")
    (tmp_path / "t.txt").write_text("held-out text")
    assert evaluate_main([str(garbled), "--text", str(tmp_path / "t.txt")]) == 2
    one_error(capsys, "load one of the run's checkpoint folders (RUN/checkpoints/step_NNNNNNN) directly")


def test_a_checkpoint_pruned_while_it_is_read_is_said_to_have_gone(trained_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step_0000003"
    real_hash = parallel.checkpoint.sha256_file

    def hash_then_prune(path):  # the job prunes the checkpoint while its files are verified
        digest = real_hash(path)
        shutil.rmtree(newest, ignore_errors=True)
        return digest

    monkeypatch.setattr(parallel.checkpoint, "sha256_file", hash_then_prune)
    with pytest.raises(UserError, match=f"{newest} disappeared while it was read") as error:
        load_model(run)
    assert "damaged" not in str(error.value) and "corrupt" not in str(error.value)
