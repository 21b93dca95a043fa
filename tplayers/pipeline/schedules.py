"""The published pipeline schedules, on torch.distributed.pipelining's own:

    ScheduleGPipe(stage, n_microbatches, loss_fn)                   all forwards, then all backwards
    Schedule1F1B(stage, n_microbatches, loss_fn)                    one forward, one backward
    ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn)        several stages per rank
    ScheduleInterleavedZeroBubble(stages, n_microbatches, loss_fn)  backward split into input and
                                                                    weight gradients, filling bubbles

`schedule.step(x, target=y)` on every rank: the batch is split into `n_microbatches` along dim
0; it returns the mean of `loss_fn(output, target)` over the micro-batches on the rank holding
the last stage, None elsewhere; every parameter's `.grad` then holds the gradient of that mean,
as the unsharded model's backward of the mean loss would give (for equal micro-batches).

What tplayers adds to torch's schedules:
- the gradient is that of the mean by construction: each micro-batch's loss is divided by the
  number of micro-batches before its backward, and torch's own rescaling after the step
  (`scale_grads`, which divides whatever `.grad` holds, so also gradients accumulated over
  several steps) is off;
- tied parameters shared by two stages (`PipelineStage(tied=...)`) have their gradients summed
  over the pipeline group after the step;
- bad input (a batch that does not split into the micro-batches, too few micro-batches for the
  schedule) is refused before anything is sent;
- a loss_fn that asks for it (`labels_to_last_stage = True`, as `tplayers.next_token_loss(model)`)
  has the target given to the last stage's forward as `labels=` too, so that a stage can score its
  labels itself (a fused LM-head cross-entropy, without logits) and hand the loss_fn a scalar;
- every stage is told the shape of the micro-batch entering the first stage, on every rank
  (`PipelineStage.tell_batch`): a stage past the first cannot see it, and a context-parallel
  decoder's stages need the sequence length to know which tokens each rank holds; and the
  first stage may refuse its batch (`PipelineStage.check_batch`: a context-parallel decoder's
  ranks must be given the same rows), the refusal raised on every rank before anything is sent.
"""

import inspect

import torch
import torch.distributed as dist

from tplayers.pipeline.stage import PipelineStage


class _Schedule:
    # torch's schedule of that name (torch.distributed.pipelining imports triton: imported when a
    # schedule is built, so that `import tplayers` does not)
    torch_class: str

    @staticmethod
    def _refuse_microbatches(n: int, ranks: int) -> str | None:
        """Why this schedule cannot run `n` micro-batches over `ranks` pipeline ranks, or None."""
        if n < ranks:
            return f"must be at least {ranks} for {ranks} pipeline ranks: every rank holds one in flight"
        return None

    def __init__(self, stages, n_microbatches: int, loss_fn):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{type(self).__name__}: needs tplayers.PipelineStage objects, got {stages!r}")
        ranks = dist.get_world_size(stages[0].group)
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be a positive int, got {n_microbatches!r}")
        why = self._refuse_microbatches(n_microbatches, ranks)
        if why:
            raise ValueError(f"{type(self).__name__}: n_microbatches ({n_microbatches}) {why}")
        self.stages, self.n_microbatches, self.loss_fn = stages, n_microbatches, loss_fn
        self._agreed = None  # the micro-batch (shape, dtype) every stage was checked against
        self._gives_labels = self._labels_to_stages()  # read once: the stages and loss_fn are fixed
        self._build()

    def _build(self):
        from torch.distributed.pipelining import schedules as torch_schedules

        torch_stages = [s.torch_stage for s in self.stages]
        self._schedule = getattr(torch_schedules, self.torch_class)(
            torch_stages if self._multi_stage else torch_stages[0],
            self.n_microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )

    _multi_stage = False

    loss_scale = 1.0  # set by train_step from the loss scaler for one step

    def _loss(self, output, target):
        # the backward of the mean over the micro-batches (times the loss scale, if any)
        return self.loss_fn(output, target) * (self.loss_scale / self.n_microbatches)

    def _labels_to_stages(self) -> bool:
        """Whether the last stage's forward is given each micro-batch's target as `labels=` too: the
        loss_fn asks for it (`labels_to_last_stage`, as `tplayers.hf.next_token_loss` does, whose
        last stage may score the labels itself) and every stage on this rank takes them."""
        return bool(getattr(self.loss_fn, "labels_to_last_stage", False)) and all(
            "labels" in inspect.signature(s.module.forward).parameters for s in self.stages
        )

    def _refuse_batch(self, x, target, first, last) -> str | None:
        """What is wrong with this rank's share of a step's arguments, or None."""
        name = f"{type(self).__name__}.step"
        if first and x is None:
            return f"{name}: the first stage needs the batch x"
        if last and target is None:
            return f"{name}: the last stage needs the target"
        for what, t in (("x", x), ("target", target)):
            if t is not None and (t.dim() == 0 or t.shape[0] % self.n_microbatches):
                return (
                    f"{name}: {what} of shape {tuple(t.shape)} does not split into {self.n_microbatches} "
                    "micro-batches along dim 0"
                )
        return None

    def step(self, x=None, *, target=None):
        """One step over the batch `x` (used on the rank of the first stage) and `target` (on the
        rank of the last); see the module docstring."""
        first = any(s.is_first for s in self.stages)
        last = any(s.is_last for s in self.stages)
        # every first stage's own check of the batch (a collective among the ranks holding it) runs
        # whatever else is wrong, then the refusals go to every rank of the pipeline together
        checked = [stage.check_batch(x) for stage in self.stages if stage.is_first]
        refusal = self._refuse_batch(x, target, first, last) or next((c for c in checked if c), None)
        self._agree_shapes(x, target if last else None, refusal)
        losses = []  # the micro-batches' losses / n, as torch's schedule computed them for backward
        kwargs = {"target": target, "losses": losses} if last else {}
        if last and self._gives_labels:  # torch gives a step's keyword arguments to each stage here
            kwargs["labels"] = target
        # no outputs kept for a merge at the end: only the losses are read
        self._schedule.step(*((x,) if first else ()), return_outputs=False, **kwargs)
        self._sum_tied_grads()
        return torch.stack([loss.detach() for loss in losses]).sum() / self.loss_scale if last else None

    def _agree_shapes(self, x, target, refusal=None):
        """Every rank learns the micro-batch's shape and dtype from the first stage's rank, and
        every rank's `refusal` of its arguments, which all then raise (one small all-gather per
        step: the batch lives on the first stage's rank, the target on the last's, so a check of
        either alone would leave the other ranks waiting). When the shapes are new, each stage in
        turn runs its module on zeros of what the stage before it produces (no grad, the RNG and
        train / eval flags left as they were) and broadcasts the shapes and dtypes of its
        outputs, or its error, to the pipeline group: a stage that cannot take what it is sent
        raises the same error on every rank before anything is sent, instead of one rank
        failing mid-schedule and the others waiting.
        A new shape after the first gets new torch stages, as torch infers the shapes travelling
        between stages once, from a stage's first step."""
        group = self.stages[0].group
        n, name = dist.get_world_size(group), type(self).__name__
        mine = None if x is None or refusal else ((x.shape[0] // self.n_microbatches, *x.shape[1:]), x.dtype)
        shared = [None] * n
        dist.all_gather_object(shared, (refusal, mine), group=group)
        refusals = [r for r, _ in shared if r]
        if refusals:
            raise ValueError(refusals[0])
        batch = [shared[0][1]]  # stage 0 lives on pipeline rank 0
        for stage in self.stages:
            stage.tell_batch(batch[0][0])
        if batch[0] == self._agreed:
            return
        here = {s.stage_index: s for s in self.stages}
        signature, sender = [batch[0]], "the batch's micro-batches"
        for index in range(self.stages[0].num_stages):
            result = [None]
            if index in here:
                last = here[index].is_last and target is not None
                target_mb = (target.shape[0] // self.n_microbatches, *target.shape[1:]) if last else None
                result[0] = _run_on_zeros(here[index], signature, self.loss_fn if last else None, target, target_mb)
            dist.broadcast_object_list(result, group=group, group_src=index % n)
            if isinstance(result[0], str):
                shapes = ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in signature)
                raise ValueError(
                    f"{name}: stage {index} (pipeline rank {index % n}) cannot take what {sender} gives it, "
                    f"{shapes}: {result[0]}"
                )
            signature, sender = result[0], f"stage {index}"
        if self._agreed is not None:  # a new shape: torch's stages inferred the old one
            for stage in self.stages:
                stage.reset()
            self._build()
        self._agreed = batch[0]

    def forward_backward(self, x, target, *, loss_scale: float = 1.0) -> torch.Tensor:
        """`step` with the loss scaled by `loss_scale` for backward (what `tplayers.train_step`
        calls); returns the unscaled mean loss on every rank (sent from the last stage's)."""
        self.loss_scale = loss_scale
        try:
            loss = self.step(x, target=target)
        finally:
            self.loss_scale = 1.0
        group = self.stages[0].group
        last_rank = (self.stages[0].num_stages - 1) % dist.get_world_size(group)
        value = (loss if loss is not None else torch.zeros(())).detach().float().reshape(1).clone()
        dist.broadcast(value, group=group, group_src=last_rank)
        return value[0]

    def _sum_tied_grads(self):
        tied = {id(p): p for s in self.stages for p in s.tied}
        group = self.stages[0].group
        for p in tied.values():  # every rank of the group holds a copy of each tied parameter
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            p.grad = grad


class ScheduleGPipe(_Schedule):
    torch_class = "ScheduleGPipe"

    @staticmethod
    def _refuse_microbatches(n, ranks):
        return None  # any number: all forwards, then all backwards


def _refuse_rounds(n, ranks):
    """torch's interleaved schedules run the micro-batches in n // ranks rounds of equal size."""
    rounds = max(1, n // ranks)
    if n < ranks:
        return _Schedule._refuse_microbatches(n, ranks)
    if n % rounds:
        return (
            f"must be a multiple of its rounds ({n} // {ranks} pipeline ranks = {rounds}): the interleaved schedules "
            "run the micro-batches in rounds of equal size"
        )
    return None


class Schedule1F1B(_Schedule):
    torch_class = "Schedule1F1B"


class ScheduleInterleaved1F1B(_Schedule):
    torch_class = "ScheduleInterleaved1F1B"
    _multi_stage = True
    _refuse_microbatches = staticmethod(_refuse_rounds)


class ScheduleInterleavedZeroBubble(_Schedule):
    torch_class = "ScheduleInterleavedZeroBubble"
    _multi_stage = True
    _refuse_microbatches = staticmethod(_refuse_rounds)


def _run_on_zeros(stage, signature, loss_fn, target, target_shape):
    """The shapes and dtypes of `stage.module`'s outputs on zeros of `signature` (and of the loss
    against zeros like `target`, on the last stage), or the error it raised, as a string."""
    modes = [(m, m.training) for m in stage.module.modules()]
    devices = [stage.device] if stage.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            stage.module.eval()  # no running statistics updated
            out = stage.module(*(torch.zeros(shape, dtype=dtype, device=stage.device) for shape, dtype in signature))
            outs = out if isinstance(out, tuple) else (out,)
            if not all(torch.is_tensor(o) for o in outs):
                return f"its module returns {type(out).__name__}, not a tensor or a tuple of tensors"
            if loss_fn is not None:
                loss_fn(out, torch.zeros(target_shape, dtype=target.dtype, device=target.device))
            return [(tuple(o.shape), o.dtype) for o in outs]
    except Exception as e:  # noqa: BLE001 -- reported on every rank, with the stage named
        return f"{type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
