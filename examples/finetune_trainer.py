"""Fine-tune a HuggingFace causal LM with LoRA through an unmodified `transformers.Trainer`
workflow, at tensor parallel 2 x data parallel 2: `tplayers.hf.Trainer` is the only change.

    torchrun --nproc-per-node 4 examples/finetune_trainer.py            # TP 2 x DP 2 (GPUs: nccl, CPU: gloo)
    python examples/finetune_trainer.py --local 4                       # the same on local CPU ranks
    torchrun --nproc-per-node 2 examples/finetune_trainer.py --dp 1     # TP 2 only

The model is a small random Llama (pass --model NAME for a Hub checkpoint; its LoRA targets are the
attention projections). It trains on synthetic rows with gradient accumulation, clipping and
checkpoints every 3 steps, evaluates, then writes the adapter as peft writes it; rank 0 prints the
loss curve and where the adapter went (`PeftModel.from_pretrained(base, path)` loads it).
"""

import argparse
import os

import peft
import torch
import transformers

import tplayers


def build(name):
    torch.manual_seed(0)
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def rows(n, vocab, seq=32, seed=0):
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def main(rank, world_size, args):
    mesh = tplayers.init_mesh(dp=args.dp, tp=world_size // args.dp)
    model = build(args.model)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(model, lora)  # LoRA first, then shard: each adapter like its base layer
    tplayers.parallelize(model, group=mesh["tp"])
    if args.dp > 1:
        tplayers.data_parallel(model, group=mesh["dp"], zero_stage=args.zero)
    vocab = model.config.vocab_size
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=3,
        eval_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    trainer = tplayers.hf.Trainer(model=model, args=training, train_dataset=rows(256, vocab),
                                  eval_dataset=rows(32, vocab, seed=1))  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.out}/adapter")  # every rank: the adapter gathered whole, as peft writes it
    if rank == 0:
        losses = [f"{h['loss']:.3f}" for h in trainer.state.log_history if "loss" in h]
        print(f"loss per step: {' '.join(losses)}; eval loss {metrics['eval_loss']:.4f}; adapter in {args.out}/adapter")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas (tp = world / dp)")
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage over the replicas")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default=None, help="a Hub causal LM (default: a small random Llama)")
    parser.add_argument("--out", default="finetune-out")
    parser.add_argument("--local", type=int, default=0, help="run on this many local CPU ranks instead of torchrun")
    args = parser.parse_args()
    if args.local:
        tplayers.launch(main, args.local, args)
    else:
        main(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), args)
