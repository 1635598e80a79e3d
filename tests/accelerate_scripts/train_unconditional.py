"""A script written for Hugging Face Accelerate in the pattern of diffusers'
examples/unconditional_image_generation/train_unconditional.py: a tiny UNet2DModel trained as a
DDPM, an EMA of its weights (diffusers' EMAModel), save/load pre-hooks that write the UNet and
the EMA in diffusers' format (the hook saves the models it is given, as diffusers' does),
checkpointing and sampling on the main process only (`if accelerator.is_main_process:`; with
`--everywhere` on every process, as a sharded model needs), the EMA passed to `prepare` (a no-op
under Accelerate; shardwise shards it like the model), and a resume through the load hook. (The
data loader does not shuffle, so a resumed run's order does not depend on how the sampler is
restored.)

    python -m torch.distributed.run --nproc-per-node 2 train_unconditional.py --out run.json --cpu \\
        --output_dir ckpts --checkpointing_steps 4 [--resume_from_checkpoint ckpts/checkpoint-4]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader, TensorDataset


def total(params):
    return float(sum(p.detach().double().sum() for p in params))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--project_dir", default=None)
    ap.add_argument("--output_dir", default=".")
    ap.add_argument("--checkpointing_steps", type=int, default=4)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--no_ema", action="store_true")
    # diffusers' own order: the EMA, built from the model's parameters before prepare, never passed to it
    ap.add_argument("--ema_as_diffusers", action="store_true")
    ap.add_argument("--no_sample", action="store_true")
    ap.add_argument("--epochs", type=int, default=2)
    # save_state and sampling on every process (under a sharded strategy they need every process)
    ap.add_argument("--everywhere", action="store_true")
    args = ap.parse_args()
    use_ema = not args.no_ema

    accelerator = Accelerator(cpu=args.cpu, project_dir=args.project_dir)
    set_seed(3)
    model = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
                        block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "UpBlock2D"))
    if use_ema:
        ema_model = EMAModel(model.parameters(), decay=0.9, use_ema_warmup=True, inv_gamma=1.0, power=0.75,
                             model_cls=UNet2DModel, model_config=model.config)
    record = {"losses": [], "saved": [], "loaded": None, "samples": []}

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            if use_ema:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
                record["saved"].append({"ema": total(ema_model.shadow_params),
                                        "dir": os.path.basename(output_dir),
                                        "model": total(weights[0].values())})
            for model in models:  # as diffusers' script: the models the hook is given, saved as they are
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()  # the hook saved this model

    def load_model_hook(models, input_dir):
        if use_ema:
            loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(loaded.state_dict())
            ema_model.to(accelerator.device)
            record["loaded"] = {"ema": total(ema_model.shadow_params),
                                "optimization_step": ema_model.optimization_step}
            del loaded
        for _ in range(len(models)):
            target = accelerator.unwrap_model(models.pop())
            loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
            target.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    noise_scheduler = DDPMScheduler(num_train_timesteps=50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-6)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(32, 1, 8, 8, generator=g) * 2 - 1
    train_dataloader = DataLoader(TensorDataset(images), batch_size=4, shuffle=False)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2,
                                 num_training_steps=len(train_dataloader) * args.epochs)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader,
                                                                           lr_scheduler)
    if use_ema:
        if not args.ema_as_diffusers:  # Accelerate: unchanged; shardwise: sharded like the model
            ema_model = accelerator.prepare(ema_model)
        ema_model.to(accelerator.device)

    global_step, first_epoch = 0, 0
    steps_per_epoch = len(train_dataloader)
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        global_step = int(os.path.basename(args.resume_from_checkpoint).split("-")[1])
        first_epoch = global_step // steps_per_epoch
        state = accelerator.get_state_dict(model)  # every process (a sharded model's is gathered)
        record["loaded"]["model"] = total(state.values())
        # what was loaded, every tensor, for the test to compare with the checkpoint's files
        names = [name for name, _ in accelerator.unwrap_model(model).named_parameters()]
        shadows = [s.full_tensor() if hasattr(s, "full_tensor") else s  # every process
                   for s in (ema_model.shadow_params if use_ema else [])]
        if accelerator.is_main_process:
            torch.save({"model": {k: v.detach().cpu() for k, v in state.items()},
                        "ema": {n: s.detach().cpu() for n, s in zip(names, shadows, strict=True)} if use_ema
                        else {}}, args.out + ".loaded.pt")

    def dump():  # the main process's record, after every step (a refused run leaves what it did)
        if accelerator.is_main_process:
            with open(args.out, "w") as f:
                json.dump(record, f)

    for _epoch in range(first_epoch, args.epochs):
        model.train()
        for batch in train_dataloader:
            clean_images = batch[0]
            noise = torch.randn(clean_images.shape, device=clean_images.device)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],),
                                      device=clean_images.device).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                if use_ema:
                    ema_model.step(model.parameters())
                global_step += 1
                record["losses"].append([global_step, loss.item()])
                dump()
                if ((accelerator.is_main_process or args.everywhere) and args.checkpointing_steps
                        and global_step % args.checkpointing_steps == 0):
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
        accelerator.wait_for_everyone()
        if (accelerator.is_main_process or args.everywhere) and not args.no_sample:
            unet = accelerator.unwrap_model(model)
            if use_ema:
                ema_model.store(unet.parameters())
                ema_model.copy_to(unet.parameters())
            pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
            generator = torch.Generator(device=pipeline.device).manual_seed(0)
            sample = pipeline(generator=generator, batch_size=2, num_inference_steps=4,
                              output_type="np").images
            if use_ema:
                ema_model.restore(unet.parameters())
            record["samples"].append(float(sample.sum()))
            dump()
    accelerator.end_training()
    record["done"] = True  # the harness checks it: the run got past end_training()
    dump()


if __name__ == "__main__":
    main()
