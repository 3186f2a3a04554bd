"""Strict configs: every named config loads; invalid values fail before any work with a helpful message."""

import pytest

from config.errors import ConfigError
from config.run import CONFIG_DIR, load_config
from parallel.resolve import micro_batching


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_named_config_loads_and_validates(name):
    config = load_config(name)
    assert config.name == name


def test_overrides_take_precedence_and_are_typed():
    config = load_config("moe-8x", ["train.steps=7", "moe.capacity_factor=null", "train.lr=1e-4",
                                    "logging.wandb=disabled"])
    assert config.train.steps == 7 and config.moe.capacity_factor is None
    assert config.train.lr == pytest.approx(1e-4) and config.logging.wandb == "disabled"


def test_a_yaml_path_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("moe:\n  num_experts: 4\n  top_k: 1\n")
    config = load_config(str(path))
    assert config.name == "mine" and config.moe.num_experts == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["moe.capcity_factor=1.0"], r"unknown config key 'moe.capcity_factor': did you mean 'moe.capacity_factor'"),
        (["trian.steps=3"], r"unknown config key 'trian': did you mean 'train'"),
        (["moe.top_k=9"], r"moe.top_k=9 must be between 1 and moe.num_experts=8"),
        (["moe.top_k=0"], r"moe.top_k=0 must be between 1"),
        (["moe.capacity_factor=0"], r"moe.capacity_factor=0.0 must be a positive number, or null for dropless"),
        (["moe.capacity_factor=-1.5"], r"capacity_factor=-1.5"),
        (["model.n_heads=7"], r"model.n_heads=7 does not divide model.d_model=192; valid head counts"),
        (["model.n_kv_heads=4"], r"model.n_kv_heads=4 must divide model.n_heads=6"),
        (["model.head_dim=7"], r"model.head_dim=7 must be a positive even number"),
        (["moe.top_k=two"], r"moe.top_k: expected an integer, got 'two'"),
        (["moe.score_func=relu"], r"moe.score_func: 'relu' is not one of 'softmax', 'sigmoid'"),
        (["train.precision=fp16"], r"train.precision: 'fp16' is not one of"),
        (["train.micro_batch_size=5"], r"train.micro_batch_size=5 must divide train.global_batch_size=16"),
        (["train.steps=0"], r"train.steps must be >= 1"),
        (["model.vocab_size=100"], r"model.vocab_size=100 is below 256"),
        (["moe.jitter_eps=1.5"], r"moe.jitter_eps must be in \[0, 1\)"),
        (["parallel.tp=0"], r"parallel.tp must be >= 1"),
        (["parallel.microbatches=0"], r"parallel.microbatches must be >= 1 or null"),
        (["parallel.grad_reduce=sometimes"], r"parallel.grad_reduce: 'sometimes' is not one of 'step', 'microbatch'"),
        (["parallel.activation_checkpointing=some"], r"parallel.activation_checkpointing: 'some' is not one of"),
        (["checkpoint.interval=0"], r"checkpoint.interval=0 must be a number of steps >= 1, 'auto' or null"),
        (["checkpoint.interval=often"], r"checkpoint.interval: 'often' matches none of"),
        (["checkpoint.keep=0"], r"checkpoint.keep=0 must be >= 1"),
        (["train.max_bad_steps=0"], r"train.max_bad_steps must be >= 1"),
        (["data.document_mask=true", "model.mtp_depth=1"], r"data.document_mask=true with model.mtp_depth=1: the "
                                                            r"multi-token prediction modules do not take"),
        (["data.document_mask=true", "data.source=ids.bin", "data.token_dtype=uint16"],
         r"data.document_mask=true finds each document's end by its data.document_end token, which a pre-tokenised "
         r".bin does not state"),
        (["train.steps"], r"must look like section.key=value"),
        (["train.steps.x=1"], r"'steps' is not a section"),
    ],
)
def test_invalid_values_raise_a_helpful_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("moe-8x", overrides)


def test_unknown_config_name_suggests_the_nearest():
    with pytest.raises(ConfigError, match="no config named 'moe-9x': did you mean 'moe-8x'"):
        load_config("moe-9x")


def test_missing_yaml_path():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/run.yaml")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("moe: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


@pytest.mark.parametrize(
    "overrides, dp, expected",
    [
        ([], 1, (16, 1)),
        ([], 4, (4, 1)),  # the global batch stays 16 sequences: 4 per data-parallel rank
        (["train.micro_batch_size=2"], 4, (2, 2)),
        (["parallel.microbatches=4"], 2, (2, 4)),
        (["parallel.microbatches=2", "train.micro_batch_size=4"], 2, (4, 2)),  # both, agreeing
    ],
)
def test_micro_batching_keeps_the_global_batch(overrides, dp, expected):
    micro, count = micro_batching(load_config("moe-8x", overrides), dp)
    assert (micro, count) == expected and micro * count * dp == 16


def test_micro_batching_gives_each_pipeline_stage_a_micro_batch_by_default():
    assert micro_batching(load_config("moe-8x"), 2, pp=2) == (4, 2)  # neither key set: pp pieces
    assert micro_batching(load_config("moe-8x", ["train.micro_batch_size=8"]), 2, pp=2) == (8, 1)  # as given


@pytest.mark.parametrize(
    "overrides, dp, message",
    [
        ([], 3, r"global_batch_size=16 must be divisible by the 3 data-parallel ranks"),
        (["parallel.microbatches=3"], 2, r"parallel.microbatches=3 must divide the per-rank batch 8"),
        (["parallel.microbatches=2", "train.micro_batch_size=2"], 2, r"disagree: the per-rank batch is 8"),
        (["train.micro_batch_size=8"], 4, r"train.micro_batch_size=8 must divide the per-rank batch 4"),
    ],
)
def test_micro_batching_refuses_a_batch_that_does_not_split(overrides, dp, message):
    with pytest.raises(ConfigError, match=message):
        micro_batching(load_config("moe-8x", overrides), dp)


@pytest.mark.parametrize("key", ["train.global_batch_size", "train.seed", "train.steps", "model.vocab_size",
                                 "parallel.tp", "checkpoint.interval", "checkpoint.keep"])
@pytest.mark.parametrize("value", [2**31, 2**63, -(2**63), 10**25])
def test_integers_beyond_what_the_code_can_take_are_refused_by_name(key, value):
    """No hang and no overflow deep in the code: an integer beyond 2^31 - 1 is refused when the config is typed."""
    with pytest.raises(ConfigError, match=rf"^{key}: {value} is beyond 2,147,483,647"):
        load_config("moe-8x", [f"{key}={value}"])


def test_the_largest_integer_a_key_takes_is_accepted():
    assert load_config("moe-8x", [f"train.steps={2**31 - 1}"]).train.steps == 2**31 - 1


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 0.001\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"key 'steps' is given twice in one mapping\s+in .*line 4"):
        load_config(str(path))
    path.write_text("train: {steps: 3}\ntrain: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match="key 'train' is given twice"):
        load_config(str(path))


def test_a_config_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file '{path}' is not UTF-8 text \(byte 9\)"):
        load_config(str(path))
