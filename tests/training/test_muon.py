"""Muon (training/muon.py): its update against torch.optim.Muon, experts one at a time, the parameter split,
the keys' validation, the layouts it accepts, and a run that trains and resumes exactly."""

from pathlib import Path

import pytest
import torch

from analysis.memory_states import model_states
from config.errors import ConfigError
from config.run import TrainConfig, load_config
from moe.transformer import MoETransformer
from parallel.layout import Layout
from parallel.resolve import resolve_layout
from tests.parallel.parity import TINY as PARITY_TINY
from tests.parallel.parity import run
from tests.training.stopped_run import stopped_after_step
from training.muon import Muon, newton_schulz
from training.optim import build_optimizer

MUON = ["train.optimizer=muon"]
ROOT = Path(__file__).resolve().parents[2]


def step_both(ours_params, reference_params, ours, reference, grads_per_step):
    """Give both optimizers the same gradients for each step and step them."""
    for grads in grads_per_step:
        for p, q, g in zip(ours_params, reference_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_a_matrix_takes_torch_muons_step_with_the_adamw_rms_scale(shape, nesterov):
    """Three steps (momentum carries over) on a tall and a wide matrix, equal to torch.optim.Muon with
    adjust_lr_fn="match_rms_adamw" (0.2 * sqrt(max(A, B))) and its decoupled weight decay."""
    torch.manual_seed(0)
    start = torch.randn(shape)
    ours_p, ref_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = Muon([{"params": [ours_p], "use_muon": True}], lr=0.02, weight_decay=0.1, momentum=0.9,
                nesterov=nesterov, ns_steps=5, update_rms=0.2)
    reference = torch.optim.Muon([ref_p], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5,
                                 adjust_lr_fn="match_rms_adamw")
    step_both([ours_p], [ref_p], ours, reference, [[torch.randn(shape)] for _ in range(3)])
    # the same bf16 iteration, batched (baddbmm) here and addmm there: equal to a bf16 rounding of the update
    # (lr * 0.2 * sqrt(40) ~ 0.025 per unit entry, bf16's relative step 2^-8)
    torch.testing.assert_close(ours_p, ref_p, atol=2e-4, rtol=0)
    assert not torch.allclose(ours_p, start, atol=1e-2)  # it moved: an update of ~0.02 per entry per step


def test_an_expert_stack_is_orthogonalised_one_expert_at_a_time():
    """A stacked [experts, in, out] weight steps as torch.optim.Muon steps each expert's [in, out] matrix alone;
    orthogonalising the stack as one [experts * in, out] matrix would give another update."""
    torch.manual_seed(1)
    experts, d_in, d_out = 3, 16, 8
    start = torch.randn(experts, d_in, d_out)
    stack = torch.nn.Parameter(start.clone())
    alone = [torch.nn.Parameter(start[e].clone()) for e in range(experts)]
    ours = Muon([{"params": [stack], "use_muon": True}], lr=0.02, weight_decay=0.1)
    reference = torch.optim.Muon(alone, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(2):
        grad = torch.randn(experts, d_in, d_out) * torch.tensor([1.0, 10.0, 0.1]).view(-1, 1, 1)
        stack.grad = grad.clone()
        for e in range(experts):
            alone[e].grad = grad[e].clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in alone]), atol=2e-4, rtol=0)
    # the coupled alternative differs by far more than the tolerance (the experts' gradients differ 100-fold)
    grad = torch.randn(experts, d_in, d_out) * torch.tensor([1.0, 10.0, 0.1]).view(-1, 1, 1)
    coupled = newton_schulz(grad.reshape(experts * d_in, d_out), 5).reshape(grad.shape).float()
    assert (newton_schulz(grad, 5).float() - coupled).abs().max() > 0.1


def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_near_one():
    """Independent of torch's code, from the definition (Jordan et al. 2024): for M = U S V^T the iteration gives
    U S' V^T, S' within their band (about 0.7 to 1.2 after 5 steps) for singular values spread 100-fold."""
    torch.manual_seed(2)
    u, _ = torch.linalg.qr(torch.randn(32, 16))
    v, _ = torch.linalg.qr(torch.randn(16, 16))
    matrix = u @ torch.diag(torch.logspace(-1, 1, 16)) @ v.T  # [32, 16], singular values 0.1 .. 10
    in_its_basis = u.T @ newton_schulz(matrix, 5).float() @ v  # diagonal exactly when the vectors are kept
    diagonal = torch.diagonal(in_its_basis)
    assert (in_its_basis - torch.diag(diagonal)).abs().max() < 0.03  # bf16 rounding of entries ~0.2
    assert diagonal.min() > 0.6 and diagonal.max() < 1.25


def test_the_adamw_groups_take_torch_adamws_step():
    torch.manual_seed(3)
    start = torch.randn(10)
    ours_p, ref_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = Muon([{"params": [ours_p], "use_muon": False}], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    reference = torch.optim.AdamW([ref_p], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    step_both([ours_p], [ref_p], ours, reference, [[torch.randn(10)] for _ in range(3)])
    torch.testing.assert_close(ours_p, ref_p, atol=1e-7, rtol=1e-6)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    config = load_config("moe-8x", [*PARITY_TINY, *MUON, "model.first_moe_layer=1", "moe.num_shared_experts=1",
                                    "moe.expert_proj_bias=true", "moe.router_bias=true"])
    model = MoETransformer(config.model, config.moe)
    optimizer = build_optimizer(model, config.train)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw_decay, adamw_plain = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False, False]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0]
    assert set(adamw_decay) == {"tok_embeddings.weight", "output.weight", "layers.1.moe.router.gate"}
    assert all(n.endswith(("norm.weight",)) or "bias" in n for n in adamw_plain) and adamw_plain
    # the routed experts' biases ([experts, width]: a vector per expert) neither take Muon's step nor decay
    assert {"layers.1.moe.experts.in_bias", "layers.1.moe.experts.out_bias"} <= set(adamw_plain)
    expected_muon = {n for n, p in model.named_parameters() if p.dim() >= 2} - set(adamw_decay) - set(adamw_plain)
    assert set(muon) == expected_muon
    # by kind: attention projections, the dense FFN of layer 0, the shared expert, the routed expert stacks
    assert {"layers.0.attn.wq.weight", "layers.1.moe.experts.w_in"} <= set(muon)
    assert any(n.startswith("layers.0.ffn") or n.startswith("layers.0.mlp") for n in muon), muon
    assert any("shared" in n for n in muon), muon
    assert len(muon) + len(adamw_decay) + len(adamw_plain) == len(list(model.parameters()))


def test_the_memory_model_counts_muons_state_as_the_optimizer_holds_it():
    """One fp32 momentum buffer per matrix Muon updates, two AdamW moments for the rest (embedding, head, router,
    norms, biases): the memory model's optimizer bytes equal the state tensors after a step (less the AdamW step
    counters, which the model leaves out)."""
    config = load_config("moe-8x", [*PARITY_TINY, *MUON, "model.first_moe_layer=1", "moe.num_shared_experts=1",
                                    "moe.expert_proj_bias=true", "model.tie_embeddings=false"])
    model = MoETransformer(config.model, config.moe)
    optimizer = build_optimizer(model, config.train)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    held = sum(value.nbytes for state in optimizer.state.values() for key, value in state.items() if key != "step")
    predicted = model_states(config, Layout.resolve(1)).optimizer
    assert held == predicted
    assert predicted < 2 * model_states(config, Layout.resolve(1)).weights  # fewer than AdamW's two moments


@pytest.mark.parametrize("key, value, message", [
    ("optimizer", "'sgd'", "train.optimizer: 'sgd' is not one of 'adamw', 'muon'"),
    ("muon_momentum", "1.0", "train.muon_momentum=1.0 must be in [0, 1)"),
    ("muon_ns_steps", "0", "train.muon_ns_steps=0 must be in [1, 99]"),
    ("muon_update_rms", "-0.2", "train.muon_update_rms=-0.2 must be a positive finite number"),
])
def test_bad_muon_keys_are_config_errors_naming_key_and_value(key, value, message):
    with pytest.raises(ConfigError) as raised:
        load_config("moe-8x", [f"train.{key}={value}"])
    assert message in str(raised.value)


def test_muon_accepts_every_layout():
    """No layout is refused under Muon, dp_shard and tp together included, and cp with tp (FSDP's strided shards of
    tp's weights, over dp_shard or dp_shard × cp, are gathered whole: ``training.muon.orthogonalised``);
    ``tests/parallel/test_parity.py`` proves the rows it runs equal to one process."""
    dropless = "moe.capacity_factor=null"
    for degrees, world in ((["parallel.tp=2", "parallel.dp_shard=1"], 2), (["parallel.ep=2"], 2),
                           (["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"], 4),
                           (["parallel.tp=2", "parallel.dp_shard=2"], 4),
                           (["parallel.tp=2", "parallel.dp_shard=1", "parallel.cp=2", dropless], 4)):
        resolve_layout(load_config("moe-8x", [*MUON, *degrees]), world)


STEPS = 6
SETTINGS = [*MUON, f"train.steps={STEPS}", "checkpoint.interval=3"]


def test_a_muon_run_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """Six steps in one go against three, a crash after step 4 and a resume from the step-3 checkpoint: the same
    losses and weights bit for bit (Muon's momentum buffers and AdamW's moments are in the checkpoint)."""
    ref_records, ref_state = run(SETTINGS, 1, tmp_path / "uninterrupted")
    ref_losses = [r["train/loss"] for r in ref_records]
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it trains (measured: 5.52 -> 4.68 in 6 steps; AdamW 4.55)

    with stopped_after_step(monkeypatch, 4):
        run(SETTINGS, 1, tmp_path / "resumed")
    records, state = run(SETTINGS, 1, tmp_path / "resumed")
    assert [(r["step"], r["train/loss"]) for r in records] == [(r["step"], r["train/loss"]) for r in ref_records]
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name


def test_train_optimizer_picks_the_optimizer_a_run_builds():
    config = load_config("moe-8x", [*PARITY_TINY, *MUON])
    assert isinstance(build_optimizer(MoETransformer(config.model, config.moe), config.train), Muon)
    assert not isinstance(build_optimizer(MoETransformer(config.model, config.moe), TrainConfig()), Muon)


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both_and_the_fresh_start(tmp_path):
    """AdamW's checkpoint resumed under Muon: a ConfigError before any tensor is loaded (DCP's own answer was a
    missing-key traceback), which names both optimizers and how to start Muon fresh from the weights."""
    run(["train.steps=2", "checkpoint.interval=2"], 1, tmp_path)
    with pytest.raises(ConfigError) as raised:
        run([*MUON, "train.steps=4", "checkpoint.interval=2"], 1, tmp_path)
    message = str(raised.value)
    assert "was saved with train.optimizer=adamw, but this run has train.optimizer=muon" in message
    assert "--set train.optimizer=adamw" in message and "--init-from FILE --resume none" in message
