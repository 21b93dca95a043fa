"""GPU check of the HF family layouts on one CUDA GPU: each tiny family model of
tests/test_families.py parallelized at TP 1 over NCCL (so every projection runs through the Triton
GEMMs with the family's column / row splits), in bf16, against the unsharded model: logits, loss and
every gradient within tplayers.tolerances' bf16 bounds.

    python bench/gpu_families.py [deepseek_v3,gpt_oss,...]      (tplayers installed: pip install -e .)

Prints one line per family; exits 1 if a gradient is off, 2 without a CUDA GPU. Multi-GPU tensor
parallelism is checked on CPU ranks by the test suite; this is the kernels' side of it.
"""

import copy
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

FAMILIES = "deepseek_v3,deepseek_v2-lite,gpt_oss,llama4_text,dbrx,phimoe,bitnet,llama"


def main(families) -> int:
    if not torch.cuda.is_available():
        print("gpu_families: no CUDA GPU visible", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    warnings.simplefilter("ignore")
    from test_families import VOCAB, tiny_model

    import tplayers
    from tplayers.hf import gather_grads
    from tplayers.tolerances import tolerance

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    failed = 0
    for family in families:
        reference = tiny_model(family, torch.bfloat16).cuda()
        model = tplayers.parallelize(copy.deepcopy(reference), group=dist.group.WORLD, verify=False)
        ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
        out, out_ref = model(ids, labels=ids), reference(ids, labels=ids)
        out.loss.backward()
        out_ref.loss.backward()
        grads, tol = gather_grads(model), tolerance(torch.bfloat16)
        off = [n for n, p in reference.named_parameters()
               if p.grad is not None and not torch.allclose(grads[n].float(), p.grad.float(), **tol)]  # fmt: skip
        failed += bool(off)
        logits = (out.logits.float() - out_ref.logits.float()).abs().max().item()
        print(f"{family:18s} logits max |d| {logits:.3g}  loss {out.loss.item():.5f} vs {out_ref.loss.item():.5f}  "
              f"gradients off: {off[:4] or 'none'}", flush=True)  # fmt: skip
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main((sys.argv[1] if len(sys.argv) > 1 else FAMILIES).split(",")))
