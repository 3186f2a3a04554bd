"""The published-size configs train as their models were trained (where the paper says how) or as a fine-tune
(where it does not), never with the toy defaults (lr 3e-3, 30 warm-up steps, 300 steps)."""

import pytest

from config.run import TrainConfig, load_config
from train import FINE_TUNING_LR_LIMIT

# (config, tokens trained on, lr, warm-up steps, sequences per step): DeepSeek-V3 arXiv:2412.19437 sec. 4.2,
# Kimi K2 arXiv:2507.20534 (67M tokens per step), GLM-4.5 arXiv:2508.06471 (64M tokens per step; warm-up unpublished)
PRE_TRAINING = [("deepseek-v3", 14.8e12, 2.2e-4, 2000, 15360), ("kimi-k2", 15.5e12, 2e-4, 500, 16384),
                ("glm-4.5", 23e12, 2.5e-4, 2000, 16384)]
FINE_TUNING = ["gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b", "qwen3-30b-a3b"]


@pytest.mark.parametrize("name, tokens, lr, warmup, batch", PRE_TRAINING, ids=[row[0] for row in PRE_TRAINING])
def test_published_pre_training_settings(name, tokens, lr, warmup, batch):
    config = load_config(name)
    train = config.train
    assert (train.lr, train.warmup_steps, train.global_batch_size, train.min_lr_ratio) == (lr, warmup, batch, 0.1)
    assert train.steps * batch * config.model.seq_len == pytest.approx(tokens, rel=1e-5)  # the published tokens


@pytest.mark.parametrize("name", FINE_TUNING)
def test_fine_tuning_configs_take_a_fine_tuning_rate(name):
    train = load_config(name).train
    assert train.lr <= FINE_TUNING_LR_LIMIT and train.lr == 2e-5 and train.weight_decay == 0.1


@pytest.mark.parametrize("name", [row[0] for row in PRE_TRAINING] + FINE_TUNING)
def test_no_published_config_keeps_the_toy_defaults(name):
    train, toy = load_config(name).train, TrainConfig()
    assert train.lr != toy.lr and train.steps != toy.steps
