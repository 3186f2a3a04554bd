"""Sample text from a trained model: greedy, or temperature with top-k and top-p, from a seed.

    moe-generate runs/moe-8x --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 1
    moe-generate runs/moe-8x --prompt "import " --greedy

The model (``inference.load_model``: a run directory, a checkpoint, an export or ``hf:DIR``) reads the prompt
once and then one token per step through its key-value cache (``moe.kv_cache.KVCache``), so a step costs one
position, not the whole prefix. Prompt plus new tokens must fit the model's context (``model.seq_len``; the
rotary tables end there): a longer request is refused before any work, naming both lengths.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from config.cli import command_parser, run_command
from config.errors import ConfigError
from inference.load import load_model
from moe.kv_cache import KVCache
from moe.transformer import MoETransformer

MAX_SEED = 2**63 - 1


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """``logits`` [V] with every token outside the top-k and outside the nucleus set to -inf.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (Holtzman et al. 2020,
    "The Curious Case of Neural Text Degeneration", sec. 3.1): a token is kept when the probability of the tokens
    ranked above it is still below ``top_p``, so the most likely token is always kept.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = before >= top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
               generator: torch.Generator | None) -> int:
    """One token from the last position's ``logits`` [V]: the most likely at temperature 0, else a sample."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


Prompt = Sequence[int] | np.ndarray | Tensor


def prompt_ids(prompt: Prompt) -> list[int]:
    """The prompt as a list of ints, from what a person has at hand: a list, what the project's tokenizers return
    (a numpy array, uint16 or uint32), or a tensor, each of shape [S] or [1, S] (one sequence: generation writes
    one). Anything else is refused by name, rather than a dtype error from deep inside the embedding."""
    shape = tuple(getattr(prompt, "shape", ()))
    if isinstance(prompt, Tensor | np.ndarray):
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        elif len(shape) != 1:
            raise ConfigError(f"the prompt has shape {list(shape)}: generate writes one sequence, so give its "
                              "tokens as [S] or [1, S]")
        kind = "torch" if isinstance(prompt, Tensor) else "numpy"
        integral = (not prompt.is_floating_point() and not prompt.is_complex() and prompt.dtype != torch.bool
                    if kind == "torch" else np.issubdtype(prompt.dtype, np.integer))
        if not integral:
            raise ConfigError(f"the prompt's tokens are {prompt.dtype}: token ids are integers")
        return [int(i) for i in prompt.tolist()]
    ids = list(prompt)
    if len(ids) == 1 and isinstance(ids[0], Sequence):  # [[ids]]: one sequence in a batch of one
        ids = list(ids[0])
    if not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
        raise ConfigError("the prompt's tokens must be integers (token ids), as a list, a numpy array or a tensor "
                          "of shape [S] or [1, S]")
    return [int(i) for i in ids]


@torch.no_grad()
def generate(model: MoETransformer, prompt: Prompt, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None, use_cache: bool = True,
             stop: Sequence[int] = ()) -> list[int]:
    """The ``max_new_tokens`` tokens (fewer if one of ``stop`` comes) that ``model`` writes after ``prompt``.

    ``prompt`` is a list of token ids, or what a tokenizer returns (``loaded.tokenizer.encode(text)``, a numpy
    array), or a tensor of shape [S] or [1, S] (``prompt_ids``). Temperature 0 is greedy. ``seed`` fixes the
    sampling (a generator of its own, so the global one is left alone). ``use_cache=False`` recomputes the whole
    sequence at every step: the reference the cache is tested against, and nothing else.
    """
    prompt = prompt_ids(prompt)
    context = model.rope_cos.shape[0]
    check_lengths(len(prompt), max_new_tokens, context)
    device = model.tok_embeddings.weight.device
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = list(prompt)
    cache = KVCache() if use_cache else None
    pending = torch.tensor([tokens], device=device)  # what the model has not read yet
    written: list[int] = []
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(torch.tensor([tokens], device=device))[0, -1]
        else:
            logits = model(pending, cache)[0, -1]
        token = next_token(logits, temperature, top_k, top_p, generator)
        tokens.append(token)
        written.append(token)
        if token in stop:
            break
        pending = torch.tensor([[token]], device=device)
    return written


def check_lengths(prompt: int, max_new_tokens: int, context: int) -> None:
    """Refuse a request the model cannot hold: an empty prompt, or one that with its new tokens passes the context."""
    if prompt < 1:
        raise ConfigError("the prompt is empty: give at least one token of text (--prompt TEXT)")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if prompt + max_new_tokens > context:
        room = context - prompt
        raise ConfigError(f"the prompt is {prompt} tokens and --max-new-tokens {max_new_tokens}: "
                          f"{prompt + max_new_tokens} tokens, more than the model's context of {context} "
                          "(model.seq_len); "
                          + (f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt"))


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int | None = None) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, {MAX_SEED:,}] (what torch's generator takes), got {seed}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-generate", __doc__)
    parser.add_argument("model", help="a run directory, a checkpoint folder, a .safetensors export or hf:DIR")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 (or --greedy): the most likely token")
    parser.add_argument("--greedy", action="store_true", help="always the most likely token (temperature 0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sample among the nucleus of probability p")
    parser.add_argument("--seed", type=int, default=None, help="fixes the sampling")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json or 'bytes' (default: the model's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)

    def body() -> None:
        temperature = 0.0 if args.greedy else args.temperature
        check_sampling(temperature, args.top_k, args.top_p, args.seed)
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        loaded = load_model(args.model, args.device, tokenizer=args.tokenizer)
        if loaded.tokenizer is None:
            raise ConfigError(f"the model's tokenizer {loaded.config.data.tokenizer!r} (data.tokenizer) is not there; "
                              "give it with --tokenizer PATH")
        prompt = prompt_ids(loaded.tokenizer.encode(args.prompt))
        check_lengths(len(prompt), args.max_new_tokens, loaded.config.model.seq_len)
        stop = loaded.config.model.eos_token_ids or ()  # an imported model's end of sequence ends the sample
        written = generate(loaded.model, prompt, args.max_new_tokens, temperature, args.top_k, args.top_p, args.seed,
                           stop=stop)
        print(loaded.tokenizer.decode(prompt + written))
        print(f"{len(written)} tokens from {loaded.source}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
