"""fp32 master weights for a model held in bf16 / fp16: `MixedPrecisionOptimizer`.

A 16-bit parameter cannot take small updates: bf16 keeps 8 bits of mantissa, so an Adam step of
lr=1e-4 on a weight of 1.0 rounds away entirely. Mixed-precision training (Micikevicius et al.
2018, "Mixed Precision Training", Sec. 3.1) keeps an fp32 master copy of every 16-bit parameter;
the optimizer and its state live on the masters, and the model's 16-bit copy is refreshed from
them after each step.

How the gradients get there: each 16-bit parameter has a post-accumulate-grad hook that adds its
fresh gradient into its master's fp32 `.grad` and drops the 16-bit one. So

- gradient accumulation over micro-batches sums in fp32 (16-bit sums lose the small terms);
- the loss scaler unscales fp32 gradients (no underflow of `grad / scale` in fp16), and an
  inf / nan from the 16-bit backward arrives as inf / nan in the fp32 copy, so it is detected;
- only one gradient buffer per parameter lives across micro-batches (the fp32 one).

The masters carry their parameter's placement (`tplayers.get_placement`), so
`clip_grad_norm_(opt.parameters(), ...)` and `DynamicLossScaler` treat them exactly as the model's
parameters. fp32 parameters (e.g. norms kept in fp32) and frozen ones are left as they are.

What follows from the gradients living on the masters:
- clear them with `opt.zero_grad()`: `model.zero_grad()` does not reach the masters. A backward
  after a step (taken, or skipped by the loss scaler) without `opt.zero_grad()` raises, rather
  than silently adding the old gradients in;
- read them through the optimizer (`opt.parameters()`, `train_step`'s result), not the model;
- torch's DistributedDataParallel reads the model's 16-bit `.grad`, which the hook has already
  moved: not supported. Reduce the masters' gradients over the data-parallel group instead
  (e.g. `tplayers.functional.comm.all_reduce(m.grad, dp_group)` before unscaling);
- weights loaded into the model after wrapping (`load_state_dict`, `load_full_state_dict`)
  must be read into the masters with `opt.reload_model_params()`, or the next step would
  restore the old ones; `opt.load_state_dict` restores masters and model together.
"""

from collections.abc import Iterator

import torch

from tplayers.placement import get_placement, set_placement
from tplayers.state import set_state, state_of

LOW_PRECISION = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer:
    """Wrap `optimizer` (any `torch.optim.Optimizer`, built over the model's parameters) so that it
    steps fp32 master copies of the model's fp16 / bf16 parameters.

    - On construction every 16-bit parameter in `optimizer.param_groups` gets an fp32 master copy
      (a parameter listed twice, e.g. tied weights, gets one), the param groups are switched to the
      masters, and any existing optimizer state is moved to them in fp32.
    - `step(closure=None)`: the wrapped optimizer steps the masters, then each model parameter is
      overwritten with its master rounded to its dtype. Returns the wrapped step's result.
    - `zero_grad(set_to_none=True)`: clears the masters' (and any stray 16-bit) gradients.
    - `param_groups`, `state`, `defaults` are the wrapped optimizer's (so `DynamicLossScaler` and
      `clip_grad_norm_` see the masters); build LR schedulers on `.optimizer`.
    - `state_dict()` holds the wrapped optimizer's state and the masters; `load_state_dict`
      restores both and refreshes the model's parameters from the masters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MixedPrecisionOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        replicated = [
            p for g in optimizer.param_groups for p in g["params"] if getattr(get_placement(p), "dp_group", None)
        ]
        if any(p.dtype in LOW_PRECISION for p in replicated):
            raise ValueError(
                "MixedPrecisionOptimizer: the model is data-parallel (tplayers.data_parallel), whose engines read the "
                "16-bit gradients this would move; keep the model in fp32 and pass "
                "data_parallel(..., param_dtype=torch.bfloat16) at ZeRO stage 2 or 3: its fp32 shards are the masters"
            )
        self.optimizer = optimizer
        self._stepped = False  # a step was taken or skipped since the last zero_grad
        self._model_params: list[torch.nn.Parameter] = []  # 16-bit parameters, in order of first listing
        self._masters: list[torch.nn.Parameter] = []
        master_of: dict[int, torch.nn.Parameter] = {}
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                if p.dtype not in LOW_PRECISION or not p.requires_grad:
                    swapped.append(p)
                    continue
                if state_of(p).has_master:
                    raise RuntimeError(
                        "a parameter already has fp32 master weights from another MixedPrecisionOptimizer: "
                        "call remove_hooks() on that one first"
                    )
                if id(p) not in master_of:
                    master_of[id(p)] = self._make_master(p)
                swapped.append(master_of[id(p)])
            group["params"][:] = swapped  # in place: some optimizers (LBFGS) hold this list
        self._move_state(master_of)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_mover(m))
            for p, m in zip(self._model_params, self._masters, strict=True)
        ]
        for p in self._model_params:
            set_state(p, has_master=True)

    def _make_master(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
        if param.grad is not None:  # a gradient already there is not lost
            master.grad = param.grad.float()
            param.grad = None
        placement = get_placement(param)
        if placement is not None:
            set_placement(master, placement.group, placement.placement)
        self._model_params.append(param)
        self._masters.append(master)
        return master

    def _move_state(self, master_of: dict) -> None:
        """Optimizer state created before wrapping follows its parameter to the master, in fp32."""
        by_id = {id(p): p for p in self._model_params}
        for key in [k for k in self.optimizer.state if id(k) in by_id]:
            moved = self.optimizer.state.pop(key)
            self.optimizer.state[master_of[id(key)]] = {
                name: v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0 else v
                for name, v in moved.items()
            }

    def _grad_mover(self, master: torch.nn.Parameter):
        def move(param: torch.Tensor) -> None:
            if self._stepped and master.grad is not None:
                raise RuntimeError(
                    "MixedPrecisionOptimizer: the fp32 master gradients of the last step are still there; "
                    "call opt.zero_grad() before the next backward (model.zero_grad() does not clear them)"
                )
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)  # fp32 += 16-bit, upcast elementwise
            param.grad = None

        return move

    # -- the optimizer interface --------------------------------------------------------------

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def parameters(self) -> Iterator[torch.Tensor]:
        """Every parameter the optimizer steps (the masters and the fp32 model parameters)."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The fp32 master of a 16-bit model parameter (the parameter itself if it is fp32)."""
        for p, m in zip(self._model_params, self._masters, strict=True):
            if p is param:
                return m
        return param

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        for p, m in zip(self._model_params, self._masters, strict=True):
            p.copy_(m)  # rounds to the parameter's dtype

    def step(self, closure=None):
        if closure is None:
            result = self.optimizer.step()
        else:  # optimizers that re-evaluate (LBFGS) must see the masters' current values

            def closure_on_masters():
                self._copy_to_model()
                with torch.enable_grad():
                    return closure()

            result = self.optimizer.step(closure_on_masters)
        self._copy_to_model()
        self._stepped = True
        return result

    def step_skipped(self) -> None:
        """Record a step skipped on overflow (`DynamicLossScaler.step` calls this): its
        gradients must be cleared before the next backward, as after a step."""
        self._stepped = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self._model_params:
            p.grad = None
        self._stepped = False

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Read the masters from the model's current 16-bit parameters (after loading weights
        into the model), as Megatron-LM's optimizer of the same name."""
        for p, m in zip(self._model_params, self._masters, strict=True):
            m.copy_(p)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach() for m in self._masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        masters = state_dict["masters"]
        if len(masters) != len(self._masters):
            raise ValueError(f"state_dict holds {len(masters)} master weights, this optimizer has {len(self._masters)}")
        for i, (mine, theirs) in enumerate(zip(self._masters, masters, strict=True)):
            if mine.shape != theirs.shape:
                raise ValueError(
                    f"master weight {i}: shape {tuple(theirs.shape)} in state_dict, {tuple(mine.shape)} here"
                )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for mine, theirs in zip(self._masters, masters, strict=True):
                mine.copy_(theirs)
        self._copy_to_model()

    def remove_hooks(self) -> None:
        """Detach from the model (its 16-bit parameters keep their own gradients again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self._model_params:
            set_state(p, has_master=False)

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({len(self._masters)} fp32 masters, {self.optimizer!r})"
