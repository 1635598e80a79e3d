"""LoRA fine-tuning with peft under zero3: token-weighted loss, `generate()` evaluation, adapter export.

    shardwise launch --config examples/configs/zero3.yaml --cpu examples/finetune_lora.py       # tiny, CPU
    shardwise launch --config examples/configs/zero3.yaml examples/finetune_lora.py \\
        --model gpt2 --steps 500 --output-dir lora-out                                          # a GPU box

The task is synthetic and needs no download: variable-length runs of consecutive token ids
(7 8 9 10 ...), padded per batch; the model learns to continue a run. The base model is built
from its config (a real job loads a pretrained one: `engine.from_pretrained`, or
`from_pretrained` on every process); only the LoRA adapters train, the base stays frozen.

- bf16 where the device has it (a CUDA GPU with bf16), else fp32.
- The loss is the token mean of the whole optimizer step (every micro-batch of every process):
  each micro-batch backpropagates its summed loss with its token count,
  `engine.backward(loss_sum, num_items=n_tokens)`, as one process on the whole batch would.
- Every `--eval-every` steps: greedy `generate()` on prompts (different ones per process, all
  processes generating together: zero3 gathers each block for every process's forward).
- At the end `save_model` writes the adapter folder (adapter_config.json +
  adapter_model.safetensors) that `PeftModel.from_pretrained(base, dir)` loads; `--merge`
  writes the merged full model instead.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset

import shardwise

PRESETS = {"tiny": (64, 2, 2), "gpt2": (768, 12, 12)}  # n_embd, n_layer, n_head
VOCAB, PAD, PROMPT, NEW = 128, 0, 4, 6  # token 0 pads; runs use 1..VOCAB-1


def build_model(name: str) -> torch.nn.Module:
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    d, layers, heads = PRESETS[name]
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=d, n_layer=layers, n_head=heads,
                     pad_token_id=PAD, bos_token_id=None, eos_token_id=None)
    # fan_in_fan_out: GPT-2's Conv1D stores weights transposed
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], lora_dropout=0.0,
                           fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(GPT2LMHeadModel(cfg), lora)


def run(start: int, length: int) -> torch.Tensor:
    return (torch.arange(start, start + length) % (VOCAB - 1)) + 1


class Runs(Dataset):
    """Runs of 8 to 32 consecutive ids: lengths differ, so token weighting matters."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        self.lengths = torch.randint(8, 33, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return run(self.starts[i], self.lengths[i])


def pad(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=PAD)
    mask = ids != PAD
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the next-token losses, the number of tokens it covers)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def evaluate(engine: shardwise.Engine, model: torch.nn.Module, prompts: int) -> tuple[float, list[int]]:
    """Greedy continuation accuracy over every process's prompts, and one sample."""
    starts = torch.arange(prompts) * 13 + 31 * engine.process_index + 5  # different prompts per process
    ids = torch.stack([run(int(s), PROMPT + NEW) for s in starts]).to(engine.device)
    model.eval()
    with torch.no_grad():
        out = engine.unwrap_model(model).generate(
            input_ids=ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]),
            max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
            synced_gpus=engine.num_processes > 1,  # every process runs each forward: zero3 gathers together
        )
    model.train()
    right = engine.gather((out[:, PROMPT:] == ids[:, PROMPT:]).float().mean(1))
    return right.mean().item(), out[0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8, help="per-process micro-batch")
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--output-dir", default="lora-adapter", help="where save_model writes the adapter")
    ap.add_argument("--merge", action="store_true", help="save the merged full model instead of the adapter")
    args, _ = ap.parse_known_args()

    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    engine = shardwise.Engine(precision="bf16" if bf16 else "fp32", grad_accum_steps=args.grad_accum, seed=0)
    model = build_model(args.model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    loader = DataLoader(Runs(args.steps * args.grad_accum * args.batch_size * engine.num_processes),
                        batch_size=args.batch_size, shuffle=True, collate_fn=pad)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    engine.print(f"{args.model} + LoRA: {trainable:,} of {total:,} parameters train, "
                 f"{engine.config.sharding.strategy}, {engine.config.sharding.precision}, "
                 f"{engine.num_processes} process(es)")

    window: list[float] = []
    for batch in loader:
        with engine.accumulate(model):
            loss, n_tokens = loss_sum(model, batch)
            engine.backward(loss, num_items=n_tokens)  # the step's token mean, over every process
            optimizer.step()
            optimizer.zero_grad()
        total_loss, tokens = engine.reduce(torch.stack([loss.detach(), n_tokens.float()]), "sum").tolist()
        window.append(total_loss / max(1.0, tokens))  # for the log: this micro-batch's token mean
        if not engine.sync_gradients:
            continue
        engine.print(f"step {engine.step:5d}  loss {sum(window) / len(window):.4f}")
        window = []
        if engine.step % args.eval_every == 0 or engine.step == args.steps:
            accuracy, sample = evaluate(engine, model, prompts=4)
            engine.print(f"eval step {engine.step:5d}  continuation accuracy {accuracy:.3f}  sample {sample}")
        if engine.step >= args.steps:
            break
    engine.save_model(model, args.output_dir, merge_adapters=args.merge)
    engine.print(f"saved the {'merged model' if args.merge else 'adapter'} to {args.output_dir}")
    engine.end_training()


if __name__ == "__main__":
    main()
