"""HuggingFace weights at scale: a model built with its parameters on the meta device,
parallelized, then filled from a HF checkpoint directory with each rank reading only the slices
it holds (`load_pretrained`); and the trained model written back as a HF directory that plain
`transformers.from_pretrained` loads (`save_pretrained`), one tensor gathered at a time.

    with tplayers.parameters_on_meta():          # parameters on meta, buffers (RoPE) real
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    tplayers.parallelize(model, group=tp, verify=False)   # shards the meta tensors: no memory
    tplayers.load_pretrained(model, path)        # this rank's slices, read from the safetensors

Weights are read with safetensors only (no pickle); a directory holding only `.bin` files is
refused unless `allow_pickle=True` (then read with `torch.load(weights_only=True)`, each whole
file on every rank).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tplayers.checkpoint.chunks import chunked, model_pieces, parameters
from tplayers.checkpoint.experts import stacked_sources
from tplayers.checkpoint.planners import CheckpointError
from tplayers.hf import lora
from tplayers.hf.state_dict import export_records, record_name, reshard, under_records
from tplayers.hf.summed_grads import carry_sum_hook
from tplayers.placement import covering_group, full_tensor, tensor_parallel_group

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


@contextmanager
def parameters_on_meta():
    """Modules built in this block get their parameters on the meta device (no memory, no
    initialisation work) and their buffers (rotary frequencies, scales) real, as HF computes them."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model, device) -> None:
    """Give every meta parameter real (uninitialised) storage of its (local) shape on `device`,
    keeping the Parameter's attributes (the placement record) and gradient hooks."""
    memo = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in memo:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                for hook in (p._backward_hooks or {}).values():
                    new.register_hook(hook)
                for hook in (p._post_accumulate_grad_hooks or OrderedDict()).values():
                    new.register_post_accumulate_grad_hook(hook)
                carry_sum_hook(p, new)
                memo[id(p)] = new
            module._parameters[name] = memo[id(p)]


def _files(path: Path, allow_pickle: bool) -> dict[str, Path]:
    """{tensor name: file} of a HF checkpoint directory."""
    for index_name, single in ((SAFE_INDEX, SAFE_SINGLE), (BIN_INDEX, BIN_SINGLE)):
        if single.endswith(".bin") and not allow_pickle and ((path / index_name).exists() or (path / single).exists()):
            raise CheckpointError(
                f"load_pretrained: {path} holds only pickled .bin weights, which can run code when read; convert "
                "them to safetensors, or pass allow_pickle=True if the files come from a source you trust"
            )
        if (path / index_name).exists():
            weight_map = json.loads((path / index_name).read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        if (path / single).exists():
            return {name: path / single for name in _names(path / single)}
    raise CheckpointError(f"load_pretrained: no {SAFE_SINGLE} or {SAFE_INDEX} in {path}")


def _names(file: Path):
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    return list(torch.load(file, map_location="meta", weights_only=True))


class _Reader:
    """Slices of tensors from the checkpoint's files, each file opened once."""

    def __init__(self):
        self.open, self.loaded = {}, {}

    def shape(self, file, name):
        if file.suffix != ".safetensors":
            return tuple(self._bin(file)[name].shape)
        return tuple(self._safe(file).get_slice(name).get_shape())

    def read(self, file, name, offsets, sizes):
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        if file.suffix != ".safetensors":
            return self._bin(file)[name][index]
        if not sizes:
            return self._safe(file).get_tensor(name)
        return self._safe(file).get_slice(name)[index]

    def _safe(self, file):
        if file not in self.open:
            from safetensors import safe_open

            self.open[file] = safe_open(file, framework="pt")
        return self.open[file]

    def _bin(self, file):
        if file not in self.loaded:
            self.loaded[file] = torch.load(file, map_location="cpu", weights_only=True)
        return self.loaded[file]


def load_pretrained(model, path, *, device=None, group=None, allow_pickle: bool = False) -> None:
    """Fill `model` (parallelized or not, pipeline stages or not, parameters on meta or real)
    from the HF checkpoint directory `path`, each rank reading only the slices it holds. Every
    tensor's name and shape is checked on every rank first; tensors of the checkpoint that no rank
    holds raise too. On every rank of `group` (default: the world; an explicit group must hold
    every group the parameters' placement records name)."""
    pg = covering_group(parameters(model), group, "load_pretrained")
    path = Path(path)
    files = _files(path, allow_pickle)
    reader = _Reader()
    pieces = model_pieces(model)
    keys = _renamed(model, files, pieces)  # {name in the model: name in its file}
    files = {name: files[key] for name, key in keys.items()}
    shared = _tied_aliases(pieces)
    stacked = {n: s for n, s in stacked_sources(files).items() if n in pieces and n not in files}
    errors, plan = [], []
    for name, ps in pieces.items():
        if name not in files and name not in stacked:
            if name not in shared or shared[name] not in files:
                errors.append(f"{name} is not in the checkpoint")
            continue
        plan.append((name, ps))
    held = [None] * dist.get_world_size(pg)
    dist.all_gather_object(held, ([n for n, _ in plan], errors), group=pg)
    errors = sorted({e for _, errs in held for e in errs})
    used = {n for names, _ in held for n in names} | set(shared)
    used |= {part for n, source in stacked.items() if n in used for part in source.names()}
    buffers = {name for name, _ in model.named_buffers()}
    errors += [
        f"{n} is in the checkpoint but not in the model" for n in sorted(files) if n not in used and n not in buffers
    ]
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise CheckpointError(
            f"load_pretrained: {path} does not fit the model: " + "; ".join(errors[:5]) + more + ". (transformers 5 "
            "renames or fuses some families' weights as it loads them, beyond experts stored one by one: load those "
            "with from_pretrained and tplayers.load_full_state_dict)"
        )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else "cpu"
    materialize(model, device)
    pieces = model_pieces(model)  # the real parameters now
    for name, _ in plan:
        target = chunked(pieces[name])
        saved = stacked[name].shape(reader) if name in stacked else reader.shape(files[name], keys[name])
        if saved != tuple(target.shape):
            raise CheckpointError(f"load_pretrained: {name} is {saved} in the checkpoint, {tuple(target.shape)} here")
        for chunk in target.chunks:
            if name in stacked:  # experts stored one by one: this rank's experts' rows of theirs
                value = stacked[name].read(reader, chunk.offsets, chunk.sizes)
            else:
                value = reader.read(files[name], keys[name], chunk.offsets, chunk.sizes)
            chunk.write(value.to(chunk.source.device))


def _renamed(model, files, pieces) -> dict[str, str]:
    """{name in the model: name in the checkpoint} for every checkpoint tensor, after the renamings
    transformers applies as it loads this model (a vision-language model's `language_model.model.*`
    saved by transformers 5 for older versions). Weights it fuses or splits (converters) keep their
    names: they are refused by name below, as before."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return {name: name for name in files}
    renamings = [m for m in get_model_conversion_mapping(model) if not isinstance(m, WeightConverter)]
    if not renamings:
        return {name: name for name in files}
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for key in files:
        name = key if key in pieces else rename_source_key(key, renamings, [], prefix, pieces)[0]
        out[name if name in pieces else key] = key
    return out


def _tied_aliases(pieces) -> dict[str, str]:
    """{name: another name holding the very same parameters} (an LM head tied to the embedding),
    which HF checkpoints store once."""
    by_params = {}
    for name, ps in pieces.items():
        by_params.setdefault(tuple(sorted(id(p.param) for p in ps)), []).append(name)
    return {a: next(b for b in names if b != a) for names in by_params.values() if len(names) > 1 for a in names}


def save_pretrained(model, path, *, group=None) -> None:
    """Write `model` as a HF directory (config, safetensors shards, index) that
    `from_pretrained` loads: each tensor gathered whole once (over TP, and ZeRO's replicas) and
    written by one rank holding it, into that rank's own file; on every rank of `group` (as
    `load_pretrained`'s). A peft model: its adapters as peft writes them (adapter_config.json,
    adapter_model.safetensors, whole tensors), which `peft.PeftModel.from_pretrained` loads on the
    unsharded base; `model.merge_and_unload()` first gives the merged HF checkpoint instead."""
    from safetensors.torch import save_file

    if lora.is_peft_model(model):
        return lora.save_adapter(model, path, group=group)
    pg = covering_group(parameters(model), group, "save_pretrained")
    tp_group = tensor_parallel_group(parameters(model), None, "save_pretrained")
    path = Path(path)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    names = sorted(model_pieces(model))
    held = [None] * world
    dist.all_gather_object(held, names, group=pg)
    writer = {}
    for r, theirs in enumerate(held):
        for n in theirs:
            writer.setdefault(n, r)
    skip = set()  # HF stores a tied LM head once, as the input embedding
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and f"{_name_of(model, head)}.weight" in _tied_aliases(model_pieces(model)):
        skip.add(f"{_name_of(model, head)}.weight")
    mine = {}
    for name, tensor in _full_tensors(model, set(names), tp_group):
        if writer.get(name) == rank and name not in skip:
            mine[name] = tensor.detach().contiguous().cpu()
    file = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=pg)
    if mine:
        save_file(mine, path / file, metadata={"format": "pt"})
    maps = [None] * world
    dist.all_gather_object(
        maps, ({n: file for n in mine}, sum(t.numel() * t.element_size() for t in mine.values())), group=pg
    )
    if rank == 0:
        weight_map = {n: f for m, _ in maps for n, f in m.items()}
        index = {
            "metadata": {"total_size": sum(size for _, size in maps)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (path / SAFE_INDEX).write_text(json.dumps(index, indent=2))
        model.config.save_pretrained(path)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(path)
    dist.barrier(group=pg)


def _full_tensors(model, names, tp_group):
    """(name, full tensor) for every state-dict tensor this rank holds, one record at a time
    (the TP gathers are collectives over each record's group, in the same order on every rank)."""
    sharded = []
    reshard(model)
    for record in export_records(model):
        sharded.append(record.prefix)
        for key, tensor in record.export(lambda p: full_tensor(p.detach()), tp_group).items():
            yield record_name(record.prefix, key), tensor
    sharded = frozenset(sharded)
    for name, value in model.state_dict().items():
        if not under_records(name, sharded) and name in names:
            yield name, full_tensor(value)


def _name_of(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


__all__ = ["load_pretrained", "materialize", "parameters_on_meta", "save_pretrained"]
