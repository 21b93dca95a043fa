"""`parallelize(verify=...)`: the self-check that the sharded model computes and trains what the
full one did.

Before sharding, the full model takes one training step's forward and backward on a small fixed
batch (the same token ids on every rank from a fixed seed, an attention mask of ones, labels =
the ids), in train mode with dropout and router jitter off: its logits, its own loss (with the
auxiliary losses its config enables: MoE load balancing) and every parameter's gradient are kept.
After sharding, the sharded model does the same, its gradients are gathered to their unsharded
form (`gather_grads`), and logits, loss and every gradient are compared with the one tolerance
table. The verdict is agreed over the group, so every rank raises, or none does; a mismatch names
the parameter and its largest error on each rank. A gradient past the table on a small fp32 model
goes to the fp64 arbiter (`_rounding_only`): the unsharded model's own fp64 gradient tells fp32
rounding the model amplifies from a wrong shard.

It costs one forward and backward of a (2, 4 * TP size) batch each way and, at its peak, the
unsharded gradients twice on every rank (the reference's and the gathered sharded ones), besides
the model. `verify="logits"` compares the logits of an eval-mode forward only (no gradients: for
models too big for that), as does a model whose logits stay split over the vocabulary.
"""

import contextlib
import copy
import inspect
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tplayers.functional.collectives import all_gather_any, all_gather_dim
from tplayers.hf import fused_loss, vision
from tplayers.hf.shard import model_embedding
from tplayers.placement import placement_or_none
from tplayers.tolerances import ARBITER_FACTOR, tolerance

PROBE_BATCH = 2
PROBE_TOKENS_PER_RANK = 4  # a multiple of the TP size, so sequence parallelism can split it
MODES = ("train", "logits")
# Module / config attributes that make a training forward random: zeroed while verifying.
NOISE = ("dropout", "jitter", "pdrop")


class VerifyError(RuntimeError):
    """The sharded model's logits, loss or gradients differ from the unsharded model's beyond the
    tolerance table."""


@dataclass
class Probe:
    """The batch verified with and what the full model computed on it."""

    ids: torch.Tensor
    mode: str  # "train" or "logits"
    images: dict = field(default_factory=dict)  # the model's other inputs: pixel_values, image_sizes
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grads: dict = field(default_factory=dict)  # {parameter name: unsharded gradient}
    kept: dict = field(default_factory=dict)  # {parameter: the .grad it had}: given back afterwards
    unsharded: nn.Module | None = None  # a copy of a small fp32 model, for the fp64 arbiter (`_rounding_only`)


def _token_model(model) -> bool:
    """An HF-style model: a config and an nn.Embedding input embedding to draw token ids for."""
    return getattr(model, "config", None) is not None and isinstance(
        model_embedding(model, "get_input_embeddings"), nn.Embedding
    )


def probe_input(model, verify, n):
    """The batch to verify with, or None where the check is off.

    verify: None (default) checks whenever every weight is materialised (not on the meta
    device) and the model takes token ids; True, "train" or "logits" insist; False turns it off;
    a tensor is the input itself, a dict the model's inputs by name with the ids as `input_ids`
    (the same on every rank)."""
    if verify is False:
        return None
    if isinstance(verify, torch.Tensor):
        return verify
    if isinstance(verify, dict):
        if not isinstance(verify.get("input_ids"), torch.Tensor):
            raise TypeError("parallelize: verify=<dict of inputs> needs the token ids as 'input_ids'")
        return verify["input_ids"]
    if verify is not None and verify is not True and verify not in MODES:
        raise TypeError(
            f"parallelize: verify must be None, True, False, 'train', 'logits' or an input tensor, got {verify!r}"
        )
    materialised = not any(p.is_meta for p in model.parameters())
    if not (materialised and _token_model(model)):
        if verify is None:
            return None
        why = "its weights are on the meta device" if not materialised else "it has no token-id input embedding"
        raise ValueError(f"parallelize(verify=True): cannot run the self-check: {why}; pass verify=<input tensor>")
    emb = model.get_input_embeddings()
    config = model.config
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = PROBE_TOKENS_PER_RANK * n
    if max_positions and seq > max_positions:
        seq = max(n, max_positions // n * n)
    generator = torch.Generator().manual_seed(0)
    vocab = min(emb.num_embeddings, getattr(config, "vocab_size", None) or emb.num_embeddings)  # ids the LM head scores
    ids = torch.randint(0, vocab, (PROBE_BATCH, seq), generator=generator)
    return ids.to(emb.weight.device)


def logits(model, ids, images=None):
    """The model's logits for `ids` (and `images`, its other inputs) in eval mode without gradients;
    training flags restored."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            kwargs = {"use_cache": False} if getattr(model, "config", None) is not None else {}
            out = vision.call_with_ids(model, ids, **kwargs, **(images or {}))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return _main_output(out)


def _main_output(out):
    """The logits of a model's output, else its first tensor (a base model's last hidden state)."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple | list) or hasattr(out, "to_tuple") else out


def check(reference, sharded, *, group, vocab_parallel, what="logits", dtype=None):
    """Raise VerifyError on every rank if any rank's sharded logits differ from the reference
    (beyond the tolerance for `dtype`, by default the reference's)."""
    if vocab_parallel:
        sharded = all_gather_any(sharded.contiguous(), sharded.dim() - 1, group)  # any vocabulary
    tol = tolerance(dtype or reference.dtype)
    if sharded.shape != reference.shape:
        excess = torch.tensor([float("inf")])
    else:
        excess = _excess(sharded, reference, tol).reshape(1).cpu()
    worst = all_gather_dim(excess, 0, group).amax()  # MAX over the group (comm has no MAX all-reduce)
    if worst.item() > 0:
        largest = (sharded.float() - reference.float()).abs().max().item() if sharded.shape == reference.shape else None
        raise VerifyError(
            f"parallelize(verify): the sharded model's {what} differ from the unsharded model's on the probe batch "
            f"beyond the tolerance for {reference.dtype} (rtol {tol['rtol']}, atol {tol['atol']}): "
            f"largest excess over the tolerance {worst.item():.3g} (this rank's largest |difference|: {largest}, "
            f"shapes {tuple(sharded.shape)} vs {tuple(reference.shape)}). Either a module was sharded wrongly or the "
            "full model was not the same on every rank. The model is given back as it was given; "
            "parallelize(verify=False) skips this check"
        )


HALF_ELEMENT_SLACK = 4  # see _excess


def _excess(actual, expected, tol) -> torch.Tensor:
    """The largest amount by which |actual - expected| exceeds the tolerance (NaN: inf): element by
    element, and for 16-bit tensors row by row (the last dim) in root mean square. Kernels that are
    each exact to their dtype round differently (a fused epilogue, flash attention against SDPA), the
    difference grows through the layers, and the largest of a million elementwise differences is a
    tail event; a wrongly sharded module moves whole rows. A single element stays bounded too, by
    HALF_ELEMENT_SLACK times the table."""
    diff, reference = (actual.float() - expected.float()).abs(), expected.float().abs()
    if expected.dtype in (torch.float16, torch.bfloat16) and expected.dim() and expected.shape[-1] > 1:
        rms = diff.square().mean(-1).sqrt() - (tol["atol"] + tol["rtol"] * reference.square().mean(-1).sqrt())
        slack = HALF_ELEMENT_SLACK
        excess = torch.maximum(rms.max(), (diff - slack * (tol["atol"] + tol["rtol"] * reference)).max())
    else:
        excess = (diff - (tol["atol"] + tol["rtol"] * reference)).max()
    return torch.where(torch.isnan(excess), torch.tensor(float("inf"), device=excess.device), excess)


# -- the training check ---------------------------------------------------------------------------
@contextlib.contextmanager
def _training_without_noise(model):
    """Train mode with dropout (modules, and the rates HF forwards read off modules and configs)
    and MoE router jitter off; everything restored after, the random state included."""
    saved, modes = [], {m: m.training for m in model.modules()}
    owners = list(model.modules())
    owners += list({id(c): c for m in owners if (c := getattr(m, "config", None)) is not None}.values())
    for owner in owners:
        for key, value in list(vars(owner).items()):
            if type(value) is float and value and any(n in key for n in NOISE):
                saved.append((owner, key, value))
                setattr(owner, key, 0.0)
        dropout = isinstance(owner, nn.modules.dropout._DropoutNd) or "Dropout" in type(owner).__name__
        if dropout and type(getattr(owner, "p", None)) is float and owner.p:  # nn.Dropout, peft's / ours
            saved.append((owner, "p", owner.p))
            owner.p = 0.0
    model.train()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for owner, key, value in reversed(saved):
            setattr(owner, key, value)
        for m, mode in modes.items():
            m.training = mode


def _accepts(model, name) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _train_forward(model, ids, images=None):
    """(logits, loss) of one training forward and backward on `ids` and `images` (the model's other
    inputs; labels = ids where the model takes labels, else the mean square of the logits)."""
    kwargs = {"use_cache": False} if getattr(model, "config", None) is not None else {}
    kwargs.update(images or {})
    if _accepts(model, "attention_mask"):
        kwargs["attention_mask"] = torch.ones_like(ids)
    labelled = _accepts(model, "labels")
    if labelled:
        kwargs["labels"] = ids
    with _training_without_noise(model):
        out = vision.call_with_ids(model, ids, **kwargs)
        logits = _main_output(out)
        loss = out.loss if labelled and getattr(out, "loss", None) is not None else logits.float().pow(2).mean()
        loss.backward()
        if logits is None:  # the loss was fused, without logits (tplayers.hf.fused_loss): they are checked too
            with torch.no_grad(), fused_loss.logits_computed(model):
                logits = vision.call_with_ids(model, ids, **kwargs).logits
    return logits.detach(), loss.detach()


def before(model, verify, n, *, vocab_parallel=False) -> Probe | None:
    """Run the full model on the probe batch (None where the check is off)."""
    ids = probe_input(model, verify, n)
    if ids is None:
        return None
    if isinstance(verify, dict):
        images = {k: v for k, v in verify.items() if k != "input_ids"}
    elif isinstance(verify, torch.Tensor):
        images = {}
    else:
        ids, images = vision.probe_images(model, ids, n)
    mode = "logits" if verify == "logits" or vocab_parallel else "train"
    if mode == "logits":
        return Probe(ids, mode, images, logits=_unsharded_logits(model, ids, images))
    params = dict(model.named_parameters())
    kept = {p: p.grad for p in params.values()}
    for p in params.values():
        p.grad = None
    probe = Probe(ids, mode, images, kept=kept)
    if _arbiter_affordable(params.values()):
        probe.unsharded = _copy_or_none(model)
    try:
        probe.logits, probe.loss = _train_forward(model, ids, images)
        probe.grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    except Exception as e:  # the unsharded model itself: nothing to compare a training step with
        if verify in ("train", True) or isinstance(verify, torch.Tensor | dict):
            given = "ids" if isinstance(verify, torch.Tensor | dict) else repr(verify)
            raise ValueError(
                f"parallelize(verify={given}): the unsharded model "
                f"fails a training step on the probe batch ({type(e).__name__}: {e}); pass verify='logits' or "
                "verify=<ids it takes>"
            ) from e
        warnings.warn(
            f"parallelize(verify): the unsharded model fails a training step on the probe batch ({type(e).__name__}: "
            f"{e}); the self-check compares the logits only",
            stacklevel=4,
        )
        probe = Probe(ids, "logits", images, logits=_unsharded_logits(model, ids, images))
    finally:
        for p, grad in kept.items():
            p.grad = grad
    return probe


def _unsharded_logits(model, ids, images):
    try:
        return logits(model, ids, images)
    except Exception as e:  # before any sharding: the probe batch is not one this model takes
        raise ValueError(
            f"parallelize(verify): the unsharded {model_name(model)} fails a forward on the probe batch of shape "
            f"{tuple(ids.shape)} ({type(e).__name__}: {e}); pass verify=<ids it takes> or verify=False"
        ) from e


def after(probe: Probe | None, model, *, group, vocab_parallel=False, expert_group=None) -> None:
    """Run the sharded model on the probe batch and compare (every rank raises, or none).
    `expert_group`: every rank of it ran the probe batch, and an expert's gradient sums the batches
    of the ranks that sent it tokens: it is compared divided by the group's size."""
    if probe is None:
        return
    if probe.mode == "logits":
        try:
            sharded_logits = logits(model, probe.ids, probe.images)
        except Exception as e:  # every rank runs the same shapes: each fails alike, none is left waiting
            raise _failed(model, e, "a forward") from e
        check(probe.logits, sharded_logits, group=group, vocab_parallel=vocab_parallel)
        return
    from tplayers.hf.state_dict import gather_grads

    params = list(model.parameters())
    for p in params:
        p.grad = None
    try:
        try:
            sharded_logits, loss = _train_forward(model, probe.ids, probe.images)
        except Exception as e:  # every rank runs the same shapes: each fails alike, none is left waiting
            raise _failed(model, e, "a training step") from e
        if expert_group is not None:
            n = dist.get_world_size(expert_group)
            for p in params:
                if p.grad is not None and getattr(placement_or_none(p), "ep_group", None) is not None:
                    p.grad.div_(n)
        check(probe.logits, sharded_logits, group=group, vocab_parallel=False)
        # the loss of a 16-bit model is computed in fp32 from 16-bit logits: the logits' tolerance
        check(probe.loss.reshape(1), loss.reshape(1), group=group, vocab_parallel=False, what="loss",
              dtype=probe.logits.dtype)  # fmt: skip
        _check_grads(probe, gather_grads(model), group)
    finally:
        for p in params:
            p.grad = probe.kept.get(p)


def model_name(model) -> str:
    """The model's class and HF model type, as messages name it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__}" + (f" ({model_type})" if model_type else "")


def failing_module(model, tb) -> str:
    """The innermost module of `model` whose code raised along traceback `tb`: "in <name>
    (<class>)", or "" where none did (the error came from outside its modules)."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = owner
        tb = tb.tb_next
    if found is None:
        return ""
    return f" in {names[id(found)] or 'the model itself'} ({type(found).__name__})"


def _failed(model, e, what) -> VerifyError:
    return VerifyError(
        f"parallelize(verify): {model_name(model)} fails in {what} on the probe batch after sharding, where the "
        f"unsharded model ran, raised{failing_module(model, e.__traceback__)}: {type(e).__name__}: {e}. tplayers "
        "does not handle something in this model exactly; the model is given back as it was given"
    )


def name_failures(model) -> None:
    """Every later forward of `model` that raises carries a note naming tplayers, the model and the
    innermost module of it that raised (a sharded module given shapes it cannot take, after
    `parallelize(verify=False)`); the error itself is left as it was."""
    model.register_forward_hook(_note_failure, with_kwargs=True, always_call=True)


NOTE = "tplayers: raised"


def _note_failure(module, args, kwargs, output):
    error = sys.exc_info()[1]  # always_call hooks run inside torch's handler of the forward's error
    if error is None or output is not None or any(n.startswith(NOTE) for n in getattr(error, "__notes__", ())):
        return
    compiled = "torch._dynamo" in type(error).__module__  # the forward ran under torch.compile
    error.add_note(
        f"{NOTE}{failing_module(module, error.__traceback__) or ' in the forward'} of "
        f"{model_name(module)}, sharded by tplayers.parallelize"
        + (
            "; torch.compile of a model tplayers parallelized is not supported yet (its sharded layers' hooks and "
            "collectives do not trace): run it without compiling"
            if compiled
            else ""
        )
    )


# A difference this small against the tensor's largest gradient is what fp32 rounding of the terms
# summed into it gives, where the model amplifies it: said in the error, never passed.
ROUNDING_OF_LARGEST = 1e-5
_ROUNDING_HINT = (
    "; or fp32 rounding the model amplifies: each difference is within 1e-5 of its tensor's largest gradient (a "
    "norm over embeddings initialised near 0, as RWKV's 1e-4 init, scales the rounding of every gradient before it "
    "by 1 / their spread; the unsharded model's own fp32 gradient differs from its fp64 one as much there)"
)


def _check_grads(probe: Probe, sharded: dict, group) -> None:
    """Every reference gradient against the sharded model's, gathered; raises on every rank with
    each rank's worst parameter if any differs beyond the table and beyond fp32 rounding
    (`_rounding_only`)."""
    worst, beyond = (0.0, "", 0.0, 0.0), {}
    for name, expected in probe.grads.items():
        actual = sharded.get(name)
        if actual is None:
            actual = torch.zeros_like(expected)
        if actual.shape != expected.shape:
            worst = max(worst, (float("inf"), name, float("nan"), float("nan")))
            continue
        excess = _excess(actual, expected, tolerance(expected.dtype)).item()
        if excess > 0:
            beyond[name] = actual
        if excess > worst[0]:
            largest = (actual.float() - expected.float()).abs().max().item()
            worst = (excess, name, largest, expected.float().abs().max().item())
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, worst, group=group)
    if all(report[0] == 0 for report in reports):
        return
    arbiter = _rounding_only(probe, beyond) if worst[0] < float("inf") else None  # this rank's verdict
    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, arbiter, group=group)
    if all(verdict is True for verdict in verdicts):
        return
    bad = [(rank, *report) for rank, report in enumerate(reports) if report[0] > 0]
    detail = "; ".join(
        f"rank {rank}: {name} (largest |difference| {largest:.3g} in gradients up to {top:.3g}, {excess:.3g} "
        "over the tolerance)"
        for rank, excess, name, largest, top in bad
    )
    rounding = all(largest <= ROUNDING_OF_LARGEST * top for _, _, _, largest, top in bad)
    judged = [v for v in verdicts if isinstance(v, str)]
    raise VerifyError(
        "parallelize(verify): after one training step's backward on the probe batch, the sharded model's "
        f"gradients differ from the unsharded model's beyond the tolerance table: {detail}. A parameter whose "
        "gradient each rank computes only part of, or a loss computed from part of the batch, gives this"
        + (f" ({judged[0]})" if judged else _ROUNDING_HINT if rounding else "")
        + ". The model is given back as it was given; parallelize(verify='logits') checks the logits "
        "alone, verify=False skips the check"
    )


# The fp64 arbiter: where a gradient differs beyond the table, the unsharded model's own fp64 gradient says
# whether that is fp32 rounding the model amplifies (attention over normed q / k without 1/sqrt(d), a norm
# over embeddings initialised near 0) or a wrong shard. Run on models small enough to copy (random-init
# models, tests), once, only when the table fails; within ARBITER_FACTOR (tplayers.tolerances) it is rounding.
ARBITER_BYTES = 64 * 2**20


def _arbiter_affordable(params) -> bool:
    params = list(params)
    return all(p.dtype == torch.float32 for p in params) and sum(p.numel() * 4 for p in params) <= ARBITER_BYTES


def _copy_or_none(model):
    try:
        return copy.deepcopy(model)
    except Exception:  # a model holding what cannot be copied: no arbiter
        return None


def _rounding_only(probe: Probe, beyond: dict):
    """True where every gradient of `beyond` (the sharded ones past the table) is as close to the
    unsharded model's fp64 gradient as the unsharded fp32 one is (within ARBITER_FACTOR); else a
    sentence saying the first that is not; None where there is no arbiter (a large model, fp32-only
    ops in the model)."""
    if not beyond:
        return True  # nothing of this rank's past the table
    if probe.unsharded is None:
        return None
    model = probe.unsharded.double()
    for module in model.modules():  # HF's grouped-GEMM experts have no fp64: its eager loop has
        if hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    images = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in probe.images.items()}
    try:
        _train_forward(model, probe.ids, images)
    except Exception:  # an op without fp64 (grouped GEMMs): no arbiter
        return None
    finally:
        probe.unsharded = None
    exact = dict(model.named_parameters())
    for name, actual in beyond.items():
        truth = exact[name].grad.detach()
        own = (probe.grads[name].double() - truth).abs().max().item()
        ours = (actual.double() - truth).abs().max().item()
        if ours > ARBITER_FACTOR * own:
            return (f"{name} is {ours:.3g} from the unsharded model's fp64 gradient, where its own fp32 one is "
                    f"{own:.3g}: wrong, not rounding")  # fmt: skip
    return True
