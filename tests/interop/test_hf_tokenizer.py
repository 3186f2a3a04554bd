"""Tokenizers travel with models: ``--init-from hf:DIR`` reads the data with ``DIR/tokenizer.json`` (or refuses a
config naming another, or byte ids for a model of another vocabulary), and export writes a tokenizer that
``transformers`` loads and that encodes text to the ids the model was trained on, with ``generation_config.json``."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml

import train
from data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe, write_tokenizer
from interop.hf import export_folder
from interop.hf_tokenizer import byte_tokenizer_json
from storage.files import sha256_file
from tests.interop.test_hf import TINY_RUN, make_hf

transformers = pytest.importorskip("transformers")
TEXTS = ["def square(x):\n    return x * x\n", "class Point:\n    x: int = 0\n", "for i in range(10):\n    pass\n"] * 20
SAMPLE = "héllo\tworld\r\n\x00\x7f ∑ 😀 end  \n\n"


def test_the_byte_tokenizer_json_gives_the_byte_ids_and_the_text_back(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_tokenizer_json())
    ours = HFTokenizer(path, path.read_bytes())
    expected = ByteTokenizer().encode(SAMPLE)
    assert ours.vocab_size == 256
    np.testing.assert_array_equal(ours.encode(SAMPLE), expected)
    assert ours.decode(expected) == SAMPLE


def bpe(folder, vocab_size=300):
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(train_bpe(TEXTS, vocab_size), folder / "tokenizer.json")
    return folder / "tokenizer.json"


def test_init_from_hf_trains_on_the_folders_tokenizer(tmp_path, capsys):
    make_hf(tmp_path / "hf", vocab_size=300)
    tokenizer = bpe(tmp_path / "hf")
    source = tmp_path / "text.txt"
    source.write_text("".join(TEXTS))
    run = ["--init-from", f"hf:{tmp_path / 'hf'}", "--run-dir", str(tmp_path / "run"), "--set", *TINY_RUN,
           f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.3"]
    assert train.main(run) == 0
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["data"]["tokenizer"] == str(tokenizer) and recorded["model"]["vocab_size"] == 300
    # the folder's context and special tokens (MixtralConfig's defaults), kept for the export
    assert (recorded["model"]["context_length"], recorded["model"]["bos_token_id"],
            recorded["model"]["eos_token_ids"]) == (64, 1, [2])
    assert f"tokenizer {tokenizer}" in capsys.readouterr().err
    # the data was tokenised with the folder's BPE: its cache is an "-hf" one, of fewer tokens than the bytes
    [cache] = [p for p in (tmp_path / "cache").rglob("*-hf*") if p.suffix == ".bin"]
    assert 0 < cache.stat().st_size // 2 < len("".join(TEXTS).encode())

    same = tmp_path / "copy.json"  # the same tokenizer elsewhere is the same tokenizer
    shutil.copy(tokenizer, same)
    config, _ = train.check(train.parse_args([*run[:2], "--set", *TINY_RUN, f"data.tokenizer={same}"]))
    assert config.data.tokenizer == str(same)

    other = bpe(tmp_path / "other", 280)
    assert train.main([*run[:2], "--run-dir", str(tmp_path / "r2"), "--set", *TINY_RUN,
                       f"data.tokenizer={other}"]) == 2
    err = capsys.readouterr().err
    assert (f"the model in {tmp_path / 'hf'} (it comes with {tokenizer}) was trained with the tokenizer "
            f"sha256:{sha256_file(tokenizer)}, and would be read here with {other} "
            f"(sha256:{sha256_file(other)})") in err
    assert "Traceback" not in err and not (tmp_path / "r2").exists()


def test_a_model_of_another_vocabulary_without_its_tokenizer_is_refused(tmp_path, capsys):
    make_hf(tmp_path / "hf", vocab_size=300)
    assert train.main(["--init-from", f"hf:{tmp_path / 'hf'}", "--run-dir", str(tmp_path / "run"),
                       "--set", *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 300 ids and no tokenizer.json; data.tokenizer=bytes would feed it byte ids" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_export_writes_a_tokenizer_transformers_loads_and_a_generation_config(tmp_path, tokenizer, capsys):
    settings = list(TINY_RUN)
    if tokenizer == "bpe":
        path = bpe(tmp_path / "tok")
        source = tmp_path / "text.txt"
        source.write_text("".join(TEXTS))
        settings += [f"data.tokenizer={path}", "model.vocab_size=300", f"data.source={source}",
                     f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.3"]
    assert train.main(["--run-dir", str(tmp_path / "run"), "--set", *settings]) == 0
    export_folder(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    assert "wrote generation_config.json, tokenizer.json, tokenizer_config.json" in capsys.readouterr().err
    if tokenizer == "bpe":
        assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == path.read_bytes()
        ours = HFTokenizer(path, path.read_bytes())
    else:
        ours = ByteTokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(SAMPLE, add_special_tokens=False)["input_ids"] == ours.encode(SAMPLE).tolist()
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.max_length == 16 and generation.do_sample is False
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_max_length"] == 16


def test_an_export_keeps_the_imported_context_and_special_tokens_and_generates_until_eos(tmp_path, capsys):
    """docs/huggingface.md's import at a shorter seq_len, then export: config.json keeps the folder's
    max_position_embeddings and its bos/eos tokens, generation_config.json has them too, and transformers'
    generate on the export stops at the end-of-sequence token. The reference: the source folder's own greedy
    tokens, generated without an end (the end token is picked among them: the first new token not seen before)."""
    from inference.generate import main as generate_main
    from interop.hf import main as hf_main

    source = make_hf(tmp_path / "hf", vocab_size=300, max_position_embeddings=64, bos_token_id=None,
                     eos_token_id=None)
    tokenizer = HFTokenizer(bpe(tmp_path / "hf"), (tmp_path / "hf" / "tokenizer.json").read_bytes())
    ids = tokenizer.encode("def square").tolist()
    prompt, count = torch.tensor([ids]), len(ids)
    free = source.generate(prompt, max_new_tokens=10, do_sample=False)[0, count:].tolist()  # no end token: all 10
    stop_at = next(i for i in range(2, 10) if free[i] not in free[:i])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=free[stop_at])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    ours, out = tmp_path / "ours.safetensors", tmp_path / "export"
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(ours), "--seq-len", "16"]) == 0
    assert hf_main(["export", str(ours), "--out", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert exported["max_position_embeddings"] == 64  # the folder's, not model.seq_len=16
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, free[stop_at])
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, free[stop_at])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    written = theirs.generate(prompt, max_new_tokens=10, do_sample=False)[0, count:].tolist()
    assert written == free[:stop_at + 1]  # stopped at the end token, after the same greedy tokens
    capsys.readouterr()
    assert generate_main([str(ours), "--prompt", "def square", "--greedy", "--max-new-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert out == tokenizer.decode(ids + free[:stop_at + 1]) + "\n"  # moe-generate stops there too
    assert err.startswith(f"{stop_at + 1} tokens from")


def test_an_export_of_a_run_takes_the_end_of_text_token_its_documents_ended_with(tmp_path):
    """No imported tokens: the tokenizer's end-of-text token that data.document_end resolved to is the eos."""
    from tokenizers import AddedToken

    from config.run import load_config
    from interop.hf_tokenizer import special_token_ids

    tokenizer = train_bpe(TEXTS, 299)
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    write_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    settings = [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "model.vocab_size=300"]
    config = load_config("moe-8x", [*settings, "data.document_end=<|endoftext|>"])
    assert special_token_ids(config) == {"eos_token_id": 299}
    assert special_token_ids(load_config("moe-8x", [*settings, "data.document_end=END"])) == {}
    assert special_token_ids(load_config("moe-8x")) == {}  # bytes: documents end with text
