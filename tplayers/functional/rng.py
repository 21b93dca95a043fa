"""Random numbers in the sharded region between a column-parallel layer and the reduction of its
work (a row-parallel layer, a sum or an all-gather over the group): dropout that stays the model's
dropout.

Dropout draws from the default generator of its tensor's device. Between a column-parallel layer
and the layer that sums its partial outputs (attention over this rank's heads, an MLP's
intermediate features) each rank draws for its own slice: as many numbers as its slice holds,
which differ between ranks where a split is uneven (3 heads over 2 ranks). Drawn from the shared
generator, the ranks' generators would part there, and the next dropout on the replicated hidden
state (GPT-2's resid_dropout) would drop different features on each rank: each rank a different
model, silently. Drawn alike on every rank (an even split), each rank's heads would get the same
masks as every other rank's, where unsharded dropout's masks are independent across heads.

Megatron keeps a second generator for the model-parallel region (its CUDA RNG states tracker).
Here the region's generator is derived, not kept: entering the region (`enter_sharded_region`, at
a column layer's output, in training), each rank reseeds the default generator from the shared
generator's state (which every rank holds alike) and its rank; leaving it (`leave_sharded_region`,
at the reduction), the shared state comes back, one draw further on every rank where the region
drew (so that the next region, or the next step, draws anew), untouched where it drew nothing (a
model without dropout consumes the shared stream as the unsharded model does: peft's lora_dropout
then draws the unsharded masks). Derived from the shared state alone, the masks repeat when
activation checkpointing recomputes a block (it restores the shared state it stashed), and every
rank's slice gets masks of its own.

The random numbers a replicated module draws (dropout on the hidden state, MoE router jitter) stay
on the shared generator, alike on every rank as long as the ranks were seeded alike (torchrun
scripts seed every rank with the same seed). Under sequence parallelism each rank holds a part of
the sequence, and a block's dropout on it is a sharded draw too: drawn from the shared generator,
every rank's part would get the same masks (tokens 0-3 and 4-7 of 8 over 2 ranks dropped alike,
where unsharded dropout draws every token's independently), and parts of different lengths (9
tokens over 4: 3, 2, 2, 2) would draw different counts and part the generators. So a block's
forward on this rank's part (`enter_sequence_region`; `sequence_split` for tplayers' layers used
directly) is a region as well: its own stream from the shared state and the rank, the shared state
given back on leaving, one draw further if the region drew (a decision drawn for the whole
sequence must then be drawn outside the blocks, as HF's layer drop is, in the model's loop over
them; stochastic depth inside a block, which HF's vision towers hold, would part the ranks, and
towers are never split by sequence). A mask every rank must draw alike
inside a region (peft's lora_dropout on a column layer's whole input, or the whole sequence's
mask of which each rank takes its part) comes from the shared state (`shared_draws`).

Whether a region drew is each rank's own finding: alike wherever every rank holds part of the
region (every rank holds heads; a width narrower than the group, with dropout inside, would leave a
rank with nothing to draw and its shared generator a draw behind).
"""

import contextlib
import hashlib

import torch
import torch.distributed as dist

_SEED_MIX = 0x9E3779B97F4A7C15  # the golden-ratio increment: ranks' seeds far apart
_SEED_BITS = (1 << 63) - 1

# The regions open, innermost last, each [generator it reseeded, the shared state to give back,
# its seeded state]: a sharded region (at most one) and sequence regions (a block, a sequence_split)
_inside: list = []
_sequence: list = []


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"tplayers: no default generator known for {device.type} tensors")


def default_generators(model) -> list[torch.Generator]:
    """The default generators `model`'s code may draw from: the CPU's, and its CUDA device's."""
    device = next(model.parameters()).device
    return [torch.default_generator] + ([_generator(device)] if device.type == "cuda" else [])


def _region_seed(generator: torch.Generator, shared: torch.Tensor, rank: int) -> int:
    """This rank's seed for a region entered at the shared generator's present state: alike on every
    rank but for the rank, without drawing (on CUDA read off the seed and Philox offset: no kernel,
    no wait for the device)."""
    if generator.device.type == "cuda":
        base = generator.initial_seed() * _SEED_MIX + generator.get_offset()
    else:
        base = int.from_bytes(hashlib.blake2b(shared.numpy().tobytes(), digest_size=8).digest(), "little")
    return (base + (rank + 1) * _SEED_MIX) & _SEED_BITS


def _advance(generator: torch.Generator) -> None:
    """One draw further, alike on every rank."""
    if generator.device.type == "cuda":
        generator.set_offset(generator.get_offset() + 4)  # the increment one kernel's draw makes
    else:
        torch.randint(2, (), generator=generator)


def _enter(device: torch.device, group) -> list:
    generator = _generator(device)
    shared = generator.get_state()
    generator.manual_seed(_region_seed(generator, shared, dist.get_rank(group)))
    return [generator, shared, generator.get_state()]


def _leave(region: list) -> None:
    """Back to the shared generator: its state entering the region, one draw further if the region
    drew (every rank's region draws alike, each for its own slice)."""
    generator, shared, seeded = region
    drew = not torch.equal(generator.get_state(), seeded)
    generator.set_state(shared)
    if drew:
        _advance(generator)


def enter_sharded_region(device: torch.device, group) -> None:
    """Draw the region's random numbers, from here on, from this rank's own stream (see the module
    docstring); nothing while already inside a region or where the group has one rank."""
    if _inside or dist.get_world_size(group) == 1:
        return
    _inside.append(_enter(device, group))


def leave_sharded_region() -> None:
    """Back to the shared generator (or the sequence region's stream) as it was entering."""
    while _inside:
        _leave(_inside.pop())


def enter_sequence_region(device: torch.device, group) -> None:
    """A forward on this rank's part of the sequence over `group` begins (module docstring)."""
    _sequence.append(_enter(device, group) if dist.get_world_size(group) > 1 else None)


def leave_sequence_region() -> None:
    """Back to the shared generator, alike on every rank whatever the parts drew (module docstring)."""
    region = _sequence.pop()
    if region is not None:
        _leave(region)


def inside_sharded_region() -> bool:
    return bool(_inside)


@contextlib.contextmanager
def shared_draws(device: torch.device):
    """Draw on `device` from the shared generator inside a region, for a mask every rank must draw
    alike (peft's lora_dropout on the whole input of a column layer, which peft runs after the base
    layer's forward entered the region); the region's own stream resumes after."""
    generator = _generator(device)
    region = next((r for r in [*_sequence, *_inside] if r is not None and r[0] is generator), None)
    if region is None:
        yield
        return
    own = generator.get_state()
    generator.set_state(region[1])
    try:
        yield
    finally:
        region[1] = generator.get_state()
        generator.set_state(own)
