"""check_parallel: prove a user's parallel model equal to its unsharded self, over layouts.

    check_parallel(build, parallelize, inputs, layouts=[Layout(tp=2), Layout(tp=2, dp=2, zero_stage=3)])

For each layout, on local gloo ranks (a WorkerPool, dp * pp * tp of them), every rank builds
the unsharded model twice under the same seed: one stays the reference, the other goes through
the user's `parallelize(model, mesh)` with the layout's ("dp", "pp", "tp") DeviceMesh. Both run
`steps` steps (forward, loss, backward, optimizer step) on the same global batch, the parallel
model on its replica's share of it; after each, the output, the loss, every gradient and every
parameter are compared through what each rank holds of each unsharded tensor (the checkpoint's
chunk description: TP placements, fused layouts, ZeRO rows, pipeline stages), with the one
tolerance table, exactly where nothing is reduced. A mismatch raises an AssertionError naming
the tensor, its placement, the layout, the step and the largest error; a rank that raises shows
its traceback; a rank that hangs is dumped (every thread's stack) after `timeout_s`.

`build`, `parallelize`, `inputs` and `loss_fn` are sent to the ranks by reference: module-level
functions (not lambdas or closures).
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tplayers.distributed import RankError
from tplayers.functional import sequence_split
from tplayers.functional.rng import default_generators
from tplayers.testing.meshes import layout_mesh
from tplayers.testing.numerics import tolerance

DEFAULT_LR = 0.1


@dataclass(frozen=True)
class _Spec:
    """What every rank needs for one layout (pickled to the pool)."""

    build: object
    parallelize: object
    inputs: object
    layout: object
    loss_fn: object
    steps: int
    optimizer: type
    optimizer_kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype | None = None
    seed: int = 0
    exact: bool | None = None
    shard_sequence: bool = False
    microbatches: int | None = None


def default_loss(output, target=None):
    """Mean of squares of the output (or its .logits), or MSE against `target` when given."""
    output = getattr(output, "logits", output)
    if target is None:
        return output.float().square().mean()
    return torch.nn.functional.mse_loss(output.float(), target.float())


def check_parallel(
    build, parallelize, inputs, *, layouts, loss_fn=None, steps=1, optimizer=None, dtype=None,
    optimizer_kwargs=None, seed=0, exact=None, shard_sequence=False, microbatches=None, pool=None, timeout_s=120.0,
):  # fmt: skip
    """Check `parallelize(build(), mesh)` against `build()` at every layout of `layouts`.

    build()                  the unsharded model (an nn.Module), called under torch.manual_seed(seed)
    parallelize(model, mesh) shards `model` (in place or returning the result) over the layout's
                             DeviceMesh with dims ("dp", "pp", "tp"), or ("dp", "pp", "tp_r",
                             "tp_c") for a grid layout (Layout(tp=(r, c)): pass
                             mesh["tp_r", "tp_c"] as the group); returns the model, or with
                             pp > 1 this rank's `PipelineStage`s (a GPipe schedule runs them).
                             parallelize(model, mesh, layout) if it takes a third argument
    inputs                   the global batch: a tensor x, or (x, target); or inputs(step) -> that;
                             or inputs(shard, shards, step) -> data shard `shard` of `shards`
                             (one per replica; the reference trains on them put together).
                             Each data-parallel replica gets its rows along dim 0
    layouts                  `tplayers.plan.Layout`s (tp, pp, dp, zero_stage, sequence_parallel)
    loss_fn(output, target)  default: mean of squares of the output (or its .logits), or MSE
    steps                    optimizer steps, everything compared after each
    optimizer                an optimizer class (default SGD), built with `optimizer_kwargs`
                             (default lr 0.1), through `tplayers.data_parallel_optimizer` for ZeRO-1.
                             Adam-like optimizers divide by the gradient's own size: a gradient
                             within tolerance near zero can move its parameter by up to lr, so
                             the parameters after a step compare reliably only under SGD
    dtype                    cast both models, and floating-point inputs and targets, to it
                             (default: as built); compared with that dtype's tolerances
    exact                    compare bit for bit (default: only where the layout reduces nothing:
                             tp = pp = dp = 1); True with integer-valued data and weights
    shard_sequence           under sequence_parallel, the model takes and returns activations split
                             along dim 1 over "tp" as torch.tensor_split splits them, any length
                             (tplayers layers used directly, run inside `sequence_split`); False (default):
                             whole ones (`tplayers.parallelize` of an HF model)
    microbatches             pipeline micro-batches (default pp)
    (dropout)                a model that draws random numbers in training: each parallel step draws
                             from the state the reference step started at; replicated tensors draw
                             the unsharded masks, a rank's heads, columns or part of the sequence its
                             own (a mismatch then says so); refused with dp, pp or cp > 1 (each part draws for its rows)
    pool                     a `WorkerPool` with at least the layouts' largest world size (default:
                             the pytest plugin's session pool, else one started for the call)
    timeout_s                per layout: a rank still running then is dumped and the check fails
    """
    from tplayers.testing import plugin

    loss_fn = loss_fn or default_loss
    _check_picklable(build=build, parallelize=parallelize, inputs=inputs, loss_fn=loss_fn)
    layouts = list(layouts)
    if not layouts:
        raise ValueError("check_parallel: layouts is empty")
    world = max(layout.tp * layout.pp * layout.dp * getattr(layout, "cp", 1) for layout in layouts)
    pool = pool or plugin.session_pool(world)
    if pool.world_size < world:
        raise ValueError(f"check_parallel: a layout needs {world} ranks but the pool has {pool.world_size}")
    optimizer = optimizer or torch.optim.SGD
    kwargs = dict(optimizer_kwargs if optimizer_kwargs is not None else {"lr": DEFAULT_LR})
    for layout in layouts:
        spec = _Spec(build, parallelize, inputs, layout, loss_fn, steps, optimizer, kwargs, dtype, seed, exact,
                     shard_sequence, microbatches)  # fmt: skip
        size = layout.tp * layout.pp * layout.dp * getattr(layout, "cp", 1)
        mesh = _mesh_sizes(layout)
        what = f"check_parallel at {_describe(layout)}"
        try:
            held = pool.run(_run_layout, size, spec, timeout_s=timeout_s, what=what, mesh=mesh)
        except RankError as e:
            reports = {r.rank: r.message for r in getattr(e, "errors", ()) if r.message.startswith(_PREFIX)}
            if reports:  # the comparison failed: an AssertionError, as users' negative controls expect
                raise ParallelMismatch(reports) from e
            raise  # the user's code (or a dead rank): its traceback, as it is
        _check_coverage(held, layout)


_PREFIX = "check_parallel: "  # how every comparison's failure begins


class ParallelMismatch(AssertionError):
    """The parallel model differs from the unsharded one. `reports`: {rank: what differs there}."""

    def __init__(self, reports: dict):
        self.reports = dict(sorted(reports.items()))
        first, *others = self.reports.items()
        more = "".join(f"\n(rank {r} also: {m.splitlines()[0][len(_PREFIX) :][:300]})" for r, m in others)
        super().__init__(f"{first[1]}\n(reported by rank {first[0]}){more}")


def _check_picklable(**fns):
    for name, fn in fns.items():
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise TypeError(
                f"check_parallel: {name}={fn!r} cannot be sent to the worker ranks ({e}); pass a module-level "
                "function (not a lambda or a closure)"
            ) from e


def _mesh_sizes(layout) -> tuple:
    """(dp, pp, tp), or (dp, pp, tp_r, tp_c) for a 2-D tensor-parallel grid, or ("cp", dp, pp, cp,
    tp) with context parallelism (a ("dp", "pp", "cp", "tp") mesh)."""
    if getattr(layout, "cp", 1) > 1:
        return ("cp", layout.dp, layout.pp, layout.cp, layout.tp)
    return (layout.dp, layout.pp, *(layout.tp_grid or (layout.tp,)))


def _describe(layout) -> str:
    tp = f"({layout.tp_grid[0]}, {layout.tp_grid[1]})" if layout.tp_grid else layout.tp
    parts = [f"tp={tp}", f"pp={layout.pp}", f"dp={layout.dp}"]
    if getattr(layout, "cp", 1) > 1:
        parts.append(f"cp={layout.cp}")
    if layout.dp > 1:
        parts.append(f"zero_stage={layout.zero_stage}")
    if layout.sequence_parallel:
        parts.append("sequence_parallel")
    return f"Layout({', '.join(parts)})"


# ---- on every rank ---------------------------------------------------------------------------


def _run_layout(rank, world, group, spec: _Spec):
    """One layout on one rank: build, parallelize, train both ways, compare. Returns what this
    rank holds of each parameter ({name: (shape, [(offsets, sizes)])}, every reference parameter
    named) for the coverage check."""
    from tplayers.checkpoint.chunks import model_pieces

    layout = spec.layout
    mesh = layout_mesh(*_mesh_sizes(layout))
    reference = _build(spec)
    model = _build(spec)
    result = _call_parallelize(spec.parallelize, model, mesh, layout)
    stages = _stages_of(result)
    module = model if stages is not None or not isinstance(result, nn.Module) else result
    exact = (
        spec.exact if spec.exact is not None else layout.tp == layout.pp == layout.dp == getattr(layout, "cp", 1) == 1
    )
    where = f"at {_describe(layout)}, rank {rank}"
    params = _trained(module, stages)
    ref_opt = spec.optimizer(reference.parameters(), **spec.optimizer_kwargs)
    opt = _optimizer(module, params, spec, layout)
    schedule = None
    pieces = model_pieces(module)
    held = {name: (tuple(p.shape), []) for name, p in _named_parameters(reference).items()}
    # A wrong shard shows here first, named, before it spoils every output and gradient after it.
    _compare_tensors(pieces, reference, "param", exact=True, where=where, step="start")
    drew = []  # True once the reference step draws random numbers
    with _noting_draws(drew):
        for step in range(spec.steps):
            x, target = (_cast(t, spec.dtype) for t in _batch(spec.inputs, step, layout.dp))
            if stages is not None and schedule is None:
                schedule = _schedule(stages, spec, layout, has_target=target is not None)
            generators = default_generators(reference)
            states = [g.get_state() for g in generators]
            expected, ref_loss = _reference_step(reference, spec.loss_fn, x, target)
            if _same_draws(generators, states, layout) and not drew:
                drew.append(True)
            output, loss = _parallel_step(module, schedule, spec, mesh, x, target)
            if output is not None:
                _compare("output", output, _my_part(expected, mesh, spec, layout), exact, where, step)
            if loss is not None:  # computed in fp32 from outputs of the models' dtype: that dtype's tolerance
                _compare("loss", loss, ref_loss.detach().float(), exact, where, step, like=next(reference.parameters()))
            _compare_tensors(pieces, reference, "grad", exact, where, step)
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            _compare_tensors(pieces, reference, "param", exact, where, step, held)
    return held


@contextlib.contextmanager
def _noting_draws(drew: list):
    """A mismatch of a model that drew random numbers says why it may be no bug."""
    try:
        yield
    except AssertionError as e:
        if not drew:
            raise
        raise AssertionError(f"{e}\n{_DRAWN_APART}") from None


_DRAWN_APART = (
    "(the model drew random numbers in training: tensor-parallel layers draw the unsharded model's masks where "
    "their tensors are whole on every rank (embedding dropout, and residual dropout without sequence parallelism), "
    "but each rank its own over its heads, columns or part of the sequence (tplayers.functional.rng), which cannot "
    "equal the unsharded draw: set those rates to 0 to compare exactly)"
)


def _call_parallelize(parallelize, model, mesh, layout):
    """parallelize(model, mesh), or parallelize(model, mesh, layout) where it takes a third
    argument (the ZeRO stage and sequence parallelism are the layout's, not the mesh's)."""
    import inspect

    try:
        inspect.signature(parallelize).bind(model, mesh, layout)
    except TypeError:
        return parallelize(model, mesh)
    return parallelize(model, mesh, layout)


def _build(spec):
    torch.manual_seed(spec.seed)
    model = spec.build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_parallel: build() must return an nn.Module, got {type(model).__name__}")
    return model.to(spec.dtype) if spec.dtype is not None else model


def _stages_of(result):
    from tplayers.pipeline import PipelineStage

    if isinstance(result, PipelineStage):
        return [result]
    if isinstance(result, list | tuple) and result and all(isinstance(s, PipelineStage) for s in result):
        return list(result)
    return None


def _trained(module, stages):
    """The parameters this rank trains: its stages' under pipeline parallelism."""
    if stages is None:
        return list(module.parameters())
    return [p for s in stages for p in s.module.parameters()]


def _optimizer(module, params, spec, layout):
    if layout.dp > 1 and layout.zero_stage == 1:
        from tplayers.data_parallel import data_parallel_optimizer

        return data_parallel_optimizer(module, spec.optimizer, **spec.optimizer_kwargs)
    return spec.optimizer(params, **spec.optimizer_kwargs)


def _schedule(stages, spec, layout, has_target):
    from tplayers.pipeline import ScheduleGPipe

    # The schedule needs a target on the last stage; where inputs give none, a placeholder (one
    # number per row) rides along and the loss ignores it.

    def loss(output, target):
        return _loss(spec.loss_fn, output, target if has_target else None)

    return ScheduleGPipe(stages, spec.microbatches or layout.pp, loss)


def _loss(loss_fn, output, target):
    return loss_fn(output) if target is None else loss_fn(output, target)


def _batch(inputs, step, shards=1):
    """The global batch (x, target or None) of `step`: `inputs` itself, inputs(step), or the
    data shards inputs(shard, shards, step) put together along dim 0 (the reference's batch;
    the parallel model's replicas take them back apart)."""
    if not callable(inputs):
        return _pair(inputs)
    import inspect

    if len(inspect.signature(inputs).parameters) < 3:
        return _pair(inputs(step))
    parts = [_pair(inputs(shard, shards, step)) for shard in range(shards)]
    if len({x.shape[0] for x, _ in parts}) > 1:
        raise ValueError(f"check_parallel: the data shards differ in size: {[x.shape[0] for x, _ in parts]} rows")
    x = torch.cat([x for x, _ in parts])
    return x, None if parts[0][1] is None else torch.cat([t for _, t in parts])


def _cast(t, dtype):
    """Floating-point inputs and targets in the models' dtype (token ids stay integers)."""
    return t.to(dtype) if dtype is not None and t is not None and t.is_floating_point() else t


def _pair(batch):
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"check_parallel: inputs must give a tensor x or (x, target), got {type(batch).__name__}")


def _reference_step(reference, loss_fn, x, target):
    output = reference(x)
    loss = _loss(loss_fn, output, target)
    loss.backward()
    return getattr(output, "logits", output).detach(), loss


def _same_draws(generators, states, layout):
    """Where the reference step drew random numbers (dropout), the parallel step draws from the same
    state: tensor-parallel layers draw the unsharded model's masks. A data-parallel replica or a
    pipeline micro-batch draws for its own rows, which cannot match: refused, naming the fix. Returns
    whether the reference drew."""
    if all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True)):
        return False
    if layout.dp > 1 or layout.pp > 1 or getattr(layout, "cp", 1) > 1:
        raise ValueError(
            f"{_PREFIX}the model draws random numbers in training (dropout, noise), and at {_describe(layout)} each "
            "replica, micro-batch or context part draws its own, unlike the unsharded model's one draw for the whole "
            "batch; set the model's dropout rates to 0, or check with dp = pp = cp = 1"
        )
    for g, s in zip(generators, states, strict=True):
        g.set_state(s)
    return True


def _rows(t, mesh):
    """This data-parallel replica's rows of the global batch `t`."""
    dp = mesh["dp"]
    n = dp.size()
    if t.shape[0] % n:
        raise ValueError(f"check_parallel: batch size {t.shape[0]} is not divisible by dp = {n}")
    return t.chunk(n, 0)[dp.get_local_rank()]


def _seq(t, mesh, spec, layout):
    if not (spec.shard_sequence and layout.sequence_parallel):
        return t
    tp = mesh["tp"]  # torch.tensor_split's parts, as tplayers splits a sequence the group does not divide
    return t.tensor_split(tp.size(), 1)[tp.get_local_rank()].contiguous()


def _my_part(t, mesh, spec, layout):
    return _seq(_rows(t, mesh), mesh, spec, layout)


def _parallel_step(module, schedule, spec, mesh, x, target):
    """(this rank's output or None, the loss averaged over replicas or None)."""
    layout = spec.layout
    x_mine = _my_part(x, mesh, spec, layout)
    t_mine = None if target is None else _my_part(target, mesh, spec, layout)
    split = spec.shard_sequence and layout.sequence_parallel
    # the whole length, for the layers' collectives where tp does not divide it (parts of different lengths)
    within = sequence_split(x.shape[1], mesh["tp"].get_group()) if split else contextlib.nullcontext()
    if schedule is not None:
        first = mesh["pp"].get_local_rank() == 0
        if t_mine is None:
            t_mine = torch.zeros(x_mine.shape[0])
        with within:
            loss = schedule.step(x_mine if first else None, target=t_mine)
        return None, None if loss is None else _replica_mean(loss.detach().float(), mesh)
    with within:
        output = module(x_mine)
    loss = _loss(spec.loss_fn, output, t_mine)
    if not split:
        loss.backward()
        return getattr(output, "logits", output).detach(), _replica_mean(loss.detach().float(), mesh)
    # A mean over this rank's part of the sequence: weighted by the part's share of the whole, the
    # TP ranks' sum is the whole sequence's mean (parts of any length), and so is its gradient.
    loss = loss / (x.shape[1] / x_mine.shape[1])  # / tp where the parts are even
    loss.backward()
    loss = loss.detach().float().clone()
    dist.all_reduce(loss, group=mesh["tp"].get_group())
    return getattr(output, "logits", output).detach(), _replica_mean(loss, mesh)


def _replica_mean(loss, mesh, dim="dp"):
    group = mesh[dim]
    if group.size() > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=group.get_group())
        loss /= group.size()
    return loss


def _compare(what, actual, expected, exact, where, step, like=None):
    actual = actual.detach()
    if actual.shape != expected.shape:
        raise AssertionError(
            f"check_parallel: {what} at step {step} has shape {tuple(actual.shape)}, the unsharded model's part "
            f"{tuple(expected.shape)} ({where})"
        )
    _assert_close(actual, expected.to(actual.dtype), exact, f"{what} at step {step} ({where})", like)


def _assert_close(actual, expected, exact, what, like=None):
    try:
        tol = tolerance((like if like is not None else expected).dtype, exact=exact)
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as e:
        diff = (actual.float() - expected.float()).abs()
        worst = diff.argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, diff.shape)) if diff.dim() else ()
        raise AssertionError(
            f"check_parallel: {what} differs from the unsharded model: largest error {diff.max().item():.3g} at "
            f"{list(index)} ({actual.flatten()[worst].item():.6g} vs {expected.flatten()[worst].item():.6g}; "
            f"{'exact' if exact else 'tolerance table'}).\n{e}"
        ) from None


def _compare_tensors(pieces, reference, kind, exact, where, step, held=None):
    """Every chunk this rank holds of every parameter (kind "param") or its gradient ("grad")
    against the same chunk of the reference's; each chunk compared goes into `held`."""
    from tplayers.checkpoint.chunks import chunked

    ref = _named_parameters(reference)
    for name, parts in pieces.items():
        if not all(isinstance(p.param, nn.Parameter) for p in parts):
            continue  # a buffer
        if name not in ref:
            raise AssertionError(f"check_parallel: the parallel model has a parameter {name!r} the unsharded one lacks")
        expected = ref[name] if kind == "param" else ref[name].grad
        tensors = [p.param if kind == "param" else p.param.grad for p in parts]
        placement = _placement(parts[0].param)
        when = "after parallelize" if step == "start" else f"at step {step}"
        what = f"{'gradient of ' if kind == 'grad' else 'parameter '}{name!r}"
        if kind == "grad" and (expected is None) != any(t is None for t in tensors):
            has = "has no gradient" if expected is not None else "has a gradient the unsharded model's lacks"
            raise AssertionError(f"check_parallel: {what} ({placement}) {when} ({where}) {has}")
        if expected is None:
            continue
        for chunk in chunked(parts, tensors).chunks:
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            part = ", ".join(f"{i.start}:{i.stop}" for i in index)
            said = f"{what}[{part}] of {tuple(expected.shape)} ({placement}) {when} ({where})"
            _assert_close(chunk.read(), expected.detach()[index].to(chunk.source.dtype), exact, said)
            if held is not None:
                held[name][1].append((chunk.offsets, chunk.sizes))


def _named_parameters(model) -> dict:
    """Every parameter under every name the state dict gives it (a tied LM head under its own too)."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, nn.Parameter)}


def _placement(param) -> str:
    from torch.distributed.tensor import DTensor

    from tplayers.placement import get_placement

    record = get_placement(param)
    if record is None or not record.is_sharded:
        said = "replicated"
    else:
        said = f"Shard({record.placement.dim}) over TP ({dist.get_world_size(record.group)} ranks)"
    if isinstance(param, DTensor):
        said += f", ZeRO rows over DP ({param.device_mesh.size()} ranks)"
    return said


def _check_coverage(held_per_rank, layout):
    """Every element of every parameter was compared on some rank."""
    for name, (shape, _) in held_per_rank[0].items():
        covered = torch.zeros(shape, dtype=torch.bool)
        for held in held_per_rank:
            for offsets, sizes in held.get(name, (shape, []))[1]:
                covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = True
        if not covered.all():
            missing = int((~covered).sum())
            raise AssertionError(
                f"check_parallel: {missing} of {covered.numel()} elements of {name!r} are held by no rank at "
                f"{_describe(layout)} (never compared: a parameter the parallel model dropped or renamed?)"
            )
