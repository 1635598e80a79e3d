"""What TRL's scripts load from the hub, made in code for tests/trainer_scripts/sft.py, dpo.py and
grpo.py (the hub is unreachable here): a word-level tokenizer with a chat template, a tiny Qwen2,
small datasets of words, and what each script reports (`--out`): the Trainer's log history, each
rank's parameter bytes held while it trains, a model's weights' checksum. Nothing here names
shardwise."""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback, set_seed

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = [
    *NUMBERS,
    "plus", "minus", "is", "what", "the", "sum", "of", "and", "say", "count", "to", "from", "yes", "no",
    "red", "blue", "green", "cat", "dog", "bird", "big", "small", "a", "an", "it", "ok", "please", "then",
    "up", "down", "after", "before", "next", "word", "words", "good", "bad", "fast", "slow", "very",
    "?", ".", ",", "!", "hi", "bye", "left", "right", "same", "other", "again", "more", "less", "all",
]  # 64 words: 71 tokens with the special ones; the model's vocabulary rounds up to an even 72

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|> ' + message['content'] + ' <|end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over SPECIAL + WORDS (split on whitespace and punctuation), with a
    chat template whose rendering of a prompt is a prefix of the prompt and its completion."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>", additional_special_tokens=SPECIAL[4:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model(tok: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny Qwen2 from its config, its weights drawn from `seed` (the same seed: the same model).
    Every parameter's first dimension is even, so 2 processes can hold exactly half of each."""
    set_seed(seed)
    config = Qwen2Config(vocab_size=len(tok) + len(tok) % 2, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(config)


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS[10:]) for _ in range(rng.randint(low, high)))


def sums(rng: random.Random) -> tuple[str, str]:
    """A question and its answer, of varying lengths: 'what is three plus four ? ...' 'seven'."""
    a, b = rng.randrange(5), rng.randrange(5)
    question = f"{words(rng, 0, 6)} what is {NUMBERS[a]} plus {NUMBERS[b]} ?"
    return question, f"{NUMBERS[a + b]} . {words(rng, 0, 8)}".strip()


class Measure(TrainerCallback):
    """Each rank's bytes of parameters held by the model it is given and by any `others` (a
    reference model: `trainer.ref_model`, read when the callback runs), read at every step's end."""

    def __init__(self, **others: Any) -> None:
        self.others = others  # name -> a callable returning the module (it may be replaced in prepare)
        self.held: dict[str, list[int]] = {"model": [], **{name: [] for name in others}}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.held["model"].append(held_bytes(model))
        for name, get in self.others.items():
            self.held[name].append(held_bytes(get()))


def held_bytes(module: torch.nn.Module) -> int:
    """The bytes of the parameters this rank holds (a DTensor's local shard; DeepSpeed ZeRO-3's
    partition, `ds_tensor`)."""
    total = 0
    for p in module.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def checksum(module: torch.nn.Module) -> str:
    """sha256 of every parameter's full value (gathered where it is sharded), in name order: equal
    iff the weights are bitwise equal. Collective where the parameters are sharded."""
    digest = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        if hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3: gathered for the read
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                full = p.detach().clone()
        else:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        digest.update(name.encode())
        digest.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def per_rank(value: Any) -> dict[int, Any]:
    """{rank: value} from every process (collective)."""
    rank = int(os.environ.get("RANK", "0"))
    if not torch.distributed.is_initialized():
        return {rank: value}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, {rank: value})
    return {k: v for d in every for k, v in d.items()}


def write(trainer: Any, out: str, **extra: Any) -> None:
    """`out` (JSON, main process): the log history, the Accelerator's class, `extra`."""
    if trainer.is_world_process_zero():
        acc = type(trainer.accelerator)
        with open(out, "w") as f:
            json.dump({"log_history": trainer.state.log_history,
                       "accelerator": f"{acc.__module__}.{acc.__name__}",
                       "global_step": trainer.state.global_step, **extra, "done": True}, f)
