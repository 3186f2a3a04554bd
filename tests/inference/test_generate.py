"""Generation against independent references: greedy tokens equal the argmax of a full forward pass repeated
(no cache), the cache gives the uncached logits, sampling follows the softmax and its filters as worked out by
hand, and greedy tokens equal ``transformers``' ``generate`` on the same Hugging Face model."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference import load_model
from inference.evaluate import main as evaluate_main
from inference.generate import filter_logits, generate, main, next_token
from moe.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[2]


def naive_greedy(model, prompt, count):
    """The reference: the whole sequence through the model at every step, the last position's argmax appended."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_with_the_cache_equals_the_argmax_of_the_full_forward_repeated(trained_run):
    model = load_model(trained_run).model
    prompt = [ord(c) for c in "def f(x):"]
    written = generate(model, prompt, 20, temperature=0)
    assert written == naive_greedy(model, prompt, 20)
    assert generate(model, prompt, 20, temperature=0, use_cache=False) == written


def test_cached_logits_equal_uncached_ones_one_token_and_a_chunk_at_a_time(trained_run):
    model = load_model(trained_run).model
    tokens = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        pieces = [model(tokens[:, :7], cache)]  # the prompt at once, then single tokens, then a chunk of 5
        pieces += [model(tokens[:, i:i + 1], cache) for i in range(7, 25)]
        pieces.append(model(tokens[:, 25:], cache))
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=2e-5)


ATTENTION_KINDS = {  # each with YaRN's scaled tables, whose positions the cache must offset too
    "latent": ["model.kv_lora_rank=12", "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4", "model.v_head_dim=5"],
    "latent, query bottleneck": ["model.kv_lora_rank=12", "model.q_lora_rank=10", "model.qk_nope_head_dim=6",
                                 "model.qk_rope_head_dim=4", "model.v_head_dim=8"],
    "partial rotary, qk-norm, GQA": ["model.rotary_dim=4", "model.qk_norm=true", "model.n_kv_heads=2"]}


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_every_attention_kind_gives_the_uncached_logits_through_the_cache(kind):
    from config.run import load_config
    from moe.transformer import MoETransformer
    config = load_config("moe-8x", ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32",
                                    "model.ffn_hidden=48", "moe.num_experts=4", "moe.expert_hidden=16",
                                    "moe.capacity_factor=null", "model.rope_scaling=yarn", "model.rope_factor=4.0",
                                    "model.rope_original_seq_len=8", *ATTENTION_KINDS[kind]])
    model = MoETransformer(config.model, config.moe, seed=0).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        pieces = [model(tokens[:, :6], cache), *(model(tokens[:, i:i + 1], cache) for i in range(6, 15)),
                  model(tokens[:, 15:], cache)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=2e-5)


def test_top_k_and_top_p_keep_the_tokens_worked_out_by_hand():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw)).nonzero().flatten().tolist()  # noqa: E731
    # the probability ranked above each token: 0, 0.5, 0.8, 0.95; a token stays while that is below p
    assert kept(top_p=0.8) == [0, 1]
    assert kept(top_p=0.81) == [0, 1, 2]
    assert kept(top_p=0.3) == [0]
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=3) == [0, 1, 2]
    assert kept(top_k=3, top_p=0.6) == [0, 1]
    assert filter_logits(logits, top_p=0.81)[:3].tolist() == logits[:3].tolist()  # kept logits untouched


def test_sampling_follows_the_tempered_softmax_and_a_seed_repeats_it():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 20000
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([next_token(logits, 2.0, None, None, generator) for _ in range(draws)]),
                            minlength=4)
    expected = torch.exp(logits / 2.0) / torch.exp(logits / 2.0).sum()  # by hand: e^(l/T) / sum
    # 4 standard errors of a binomial proportion: fails by chance about once in 16,000 runs
    assert ((counts / draws - expected).abs() <= 4 * (expected * (1 - expected) / draws).sqrt()).all()
    one = [next_token(logits, 1.0, None, 0.6, torch.Generator().manual_seed(3)) for _ in range(50)]
    assert set(one) == {0}  # p(0) = 0.64 >= 0.6: the nucleus is the top token alone


def test_sampling_is_seeded_and_top_k_1_is_greedy(trained_run):
    model = load_model(trained_run).model
    prompt = [ord(c) for c in "import "]
    first = generate(model, prompt, 15, temperature=1.0, seed=7)
    assert generate(model, prompt, 15, temperature=1.0, seed=7) == first
    assert generate(model, prompt, 15, temperature=1.0, top_k=1, seed=8) == generate(model, prompt, 15, 0)


def test_greedy_tokens_equal_transformers_generate_on_the_same_hf_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.interop.test_hf import make_hf  # a random tiny Mixtral saved as an HF folder

    reference = make_hf(tmp_path / "hf").eval()
    ours = load_model(f"hf:{tmp_path / 'hf'}", seq_len=64).model
    prompt = [5, 77, 200, 3, 41, 9]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    generation_config=transformers.GenerationConfig(pad_token_id=0))
    assert generate(ours, prompt, 24, temperature=0) == theirs[0, len(prompt):].tolist()


def test_the_command_writes_text_and_refuses_bad_requests_with_status_2(trained_run, capsys):
    assert main([str(trained_run), "--prompt", "def ", "--max-new-tokens", "5", "--greedy"]) == 0
    out, err = capsys.readouterr()
    written = naive_greedy(load_model(trained_run).model, list(b"def "), 5)
    assert out == bytes(list(b"def ") + written).decode("utf-8", errors="replace") + "\n"
    assert "5 tokens from" in err
    cases = [(["--prompt", "x" * 30, "--max-new-tokens", "5"], "35 tokens, more than the model's context of 32"),
             (["--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
             (["--prompt", "x", "--temperature", "nan"], "(0 is greedy), got nan"),
             (["--prompt", "x", "--seed", str(2**64)], "--seed must be in [0, 9,223,372,036,854,775,807]"),
             (["--prompt", "x", "--device", "banana"], "--device 'banana': not a device name"),
             (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
             (["--prompt", "", "--max-new-tokens", "5"], "the prompt is empty"),
             (["--prompt", "x", "--tokenizer", "missing.json"], "missing.json")]
    if not torch.cuda.is_available():
        cases.append((["--prompt", "x", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU here"))
    for extra, message in cases:
        assert main([str(trained_run), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
    assert main([str(trained_run.parent / "nowhere"), "--prompt", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_a_damaged_or_partial_checkpoint_is_named_with_status_2(trained_run, tmp_path, capsys):
    damaged = tmp_path / "step_0000003"
    shutil.copytree(trained_run / "checkpoints" / "step_0000003", damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # a partial copy
    partial = tmp_path / "partial"
    shutil.copytree(trained_run / "checkpoints" / "step_0000003", partial)
    (partial / "manifest.json").unlink()  # a save that never finished
    for folder, message in [(damaged, shard.name), (partial, "manifest.json")]:
        for command in (main, evaluate_main):
            extra = ["--prompt", "x"] if command is main else ["--text", str(ROOT / "README.md")]
            assert command([str(folder), *extra]) == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, err


def test_the_console_script_runs_through_python_m(trained_run):
    done = subprocess.run([sys.executable, "-m", "inference.generate", str(trained_run), "--prompt", "a",
                           "--max-new-tokens", "3", "--seed", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "3 tokens from" in done.stderr, done.stderr


def test_generate_takes_the_tokenizers_output_lists_and_tensors_as_documented(trained_run):
    """docs/journeys.md's call as written: the tokenizer's uint16 array; and the same prompt as a list, a [S]
    and a [1, S] tensor and a [1, S] array give the same tokens. A batch of two, or float ids, is refused."""
    from config.errors import ConfigError

    loaded = load_model(trained_run)
    written = generate(loaded.model, loaded.tokenizer.encode("def main("), 8, temperature=0)
    ids = loaded.tokenizer.encode("def main(")
    assert ids.dtype.name == "uint16" and written == naive_greedy(loaded.model, ids.tolist(), 8)
    for prompt in (ids.tolist(), torch.tensor(ids.tolist()), torch.tensor([ids.tolist()]), ids[None, :]):
        assert generate(loaded.model, prompt, 8, temperature=0) == written
    assert isinstance(loaded.tokenizer.decode(written), str)
    with pytest.raises(ConfigError, match=r"\[2, 9\].*\[S\] or \[1, S\]"):
        generate(loaded.model, torch.zeros(2, 9, dtype=torch.long), 4)
    with pytest.raises(ConfigError, match="integers"):
        generate(loaded.model, torch.zeros(9), 4)
