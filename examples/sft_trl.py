"""Supervised fine-tuning with TRL's `SFTTrainer` on a tensor-parallel model:
`tplayers.hf.parallel_trainer(SFTTrainer)` is the only change (any Trainer subclass works alike).

    torchrun --nproc-per-node 2 examples/sft_trl.py         # TP 2 (GPUs: nccl, CPU: gloo)
    python examples/sft_trl.py --local 2                    # the same on local CPU ranks

A small random Llama with a word-level tokenizer built here (pass --model NAME for a Hub
checkpoint and its tokenizer), LoRA on the attention projections, pre-tokenized synthetic text.
TRL's fused LM head (which would score labels against one rank's slice of the vocabulary) is
computed from the model's whole logits. Rank 0 prints the loss and token accuracy per step.
"""

import argparse
import os

import datasets
import peft
import torch
import transformers
from trl import SFTConfig, SFTTrainer

import tplayers

VOCAB = 256


def build(name):
    torch.manual_seed(0)
    if name:
        return (transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32),
                transformers.AutoTokenizer.from_pretrained(name))  # fmt: skip
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<eos>": VOCAB - 2, "<pad>": VOCAB - 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                                     pad_token="<pad>", unk_token="w0")  # fmt: skip
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=VOCAB - 1,
                                      eos_token_id=VOCAB - 2)  # fmt: skip
    return transformers.LlamaForCausalLM(config), tokenizer


def main(rank, world_size, args):
    mesh = tplayers.init_mesh(tp=world_size)
    model, tokenizer = build(args.model)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = tplayers.parallelize(peft.get_peft_model(model, lora), group=mesh["tp"])
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab - 2, (256, 32), generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    gpu = torch.cuda.is_available()
    config = SFTConfig(output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       max_steps=args.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                       use_cpu=not gpu, bf16=gpu, disable_tqdm=True)  # fmt: skip
    trainer = tplayers.hf.parallel_trainer(SFTTrainer)(model=model, args=config, train_dataset=data,
                                                       processing_class=tokenizer)  # fmt: skip
    trainer.train()
    if rank == 0:
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']}: loss {h['loss']:.4f}, token accuracy {h['mean_token_accuracy']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=None, help="a Hub causal LM (default: a small random Llama)")
    parser.add_argument("--out", default="sft-out")
    parser.add_argument("--local", type=int, default=0, help="run on this many local CPU ranks instead of torchrun")
    args = parser.parse_args()
    if args.local:
        tplayers.launch(main, args.local, args)
    else:
        main(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), args)
