"""A config.json number or switch of the wrong JSON type (a string, list or null where a number belongs, a float
where a count does, a string where true/false does) is refused by config.json's own key name before any family
code reads it: it used to give ``TypeError`` tracebacks, messages under our key names (``model.d_model``), or be
taken (``"7"`` as ``tie_word_embeddings`` is true to ``bool``). Null stays accepted where it has a meaning."""

import json
import re

import pytest

from config.errors import ConfigError
from config.run import load_config
from interop.hf import hf_run_config, main
from tests.interop.hf_models import edit_config
from tests.interop.test_hf import SEQ, make_hf

CASES = [
    ({"hidden_size": "32"}, "config.json hidden_size='32' is a string: it must be an integer"),
    ({"num_hidden_layers": [2]}, "config.json num_hidden_layers=[2] is a list: it must be an integer"),
    ({"max_position_embeddings": 64.0}, "config.json max_position_embeddings=64.0 is a float: it must be an integer"),
    ({"rms_norm_eps": None}, "config.json rms_norm_eps=None is a null: it must be a number"),
    ({"sliding_window": "7"}, "config.json sliding_window='7' is a string: it must be an integer (or null)"),
    ({"num_experts_per_tok": True}, "config.json num_experts_per_tok=True is a boolean: it must be an integer"),
    ({"tie_word_embeddings": "yes"}, "config.json tie_word_embeddings='yes' is a string: it must be true or false"),
    ({"qk_rope_head_dim": None}, "config.json qk_rope_head_dim=None is a null: it must be an integer"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     "config.json rope_parameters.rope_theta='1e4' is a string: it must be a number"),
    ({"rope_scaling": [1]}, "config.json rope_scaling=[1] must be a mapping of rope settings (or null)"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("types") / "hf"
    make_hf(path)
    return path


def test_each_wrong_type_is_refused_by_its_key(folder):
    original = (folder / "config.json").read_text()
    try:
        for change, message in CASES:
            (folder / "config.json").write_text(original)
            edit_config(folder, **change)
            with pytest.raises(ConfigError, match=re.escape(f"{folder}: {message}")):
                hf_run_config(load_config("moe-8x"), folder, SEQ)
    finally:
        (folder / "config.json").write_text(original)


def test_null_where_it_means_the_default_is_taken(folder, tmp_path):
    original = (folder / "config.json").read_text()
    try:
        edit_config(folder, num_key_value_heads=None, head_dim=None)  # multi-head attention, hidden / heads wide
        config = hf_run_config(load_config("moe-8x"), folder, SEQ)
        assert config.model.kv_heads == config.model.n_heads == json.loads(original)["num_attention_heads"]
    finally:
        (folder / "config.json").write_text(original)


def test_the_command_says_it_in_one_line(folder, tmp_path, capsys):
    original = (folder / "config.json").read_text()
    try:
        edit_config(folder, num_local_experts=None)
        assert main(["import", str(folder), "--out", str(tmp_path / "o.safetensors"), "--seq-len", str(SEQ)]) == 2
    finally:
        (folder / "config.json").write_text(original)
    err = capsys.readouterr().err
    assert "config.json num_local_experts=None is a null: it must be an integer" in err and "Traceback" not in err
