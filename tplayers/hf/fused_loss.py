"""The loss without logits: a training forward given labels scores them with the fused LM-head
cross-entropy instead of computing the (tokens x vocabulary) logits.

An HF causal LM's forward ends `logits = self.lm_head(hidden)`, then
`loss = self.loss_function(logits=logits, labels=labels, vocab_size=..., **kwargs)` (HF's
`ForCausalLMLoss`: labels shifted by one, cross-entropy in fp32 over the rows not ignore_index,
their mean or their sum over `num_items_in_batch`). For such a model the LM head is a
`tplayers.nn.ParallelLMHead`, and `install` adds:
  - a forward pre-hook: in train mode with `labels=` given, the head defers its logits (returns a
    placeholder, see tplayers.nn.lm_head);
  - `model.loss_function` = `causal_lm_loss`: HF's loss, computed from the head's input by the
    fused kernel when handed a placeholder (vocabulary-parallel under TP: each rank scores its
    slice, per-row statistics combined over the group, nothing gathered), else HF's own;
  - a forward hook: the output's `logits` are None (Liger Kernel's and HF's convention for a
    loss computed without them); eval mode, or no labels, gives the logits as before.

Only a forward known to do nothing else with the logits is fused: the forward's source is read
once (`unfused_because`): the head called once, its result named, that name used only as the
loss function's logits and in the output. A logit softcap, scale or any other use (Gemma 2's
softcapping, Cohere's logit_scale, Granite's logits_scaling), a custom `loss_function`, or a
loss type other than ForCausalLM keeps the logits path, unchanged. A branch on a config value
that is None (`if self.config.final_logit_softcapping is not None:`) is not taken and not read.
The placeholder is a meta tensor: a use the reading missed fails loudly, never silently.
"""

import ast
import inspect
import textwrap

import torch.nn.functional as F

from tplayers.nn.lm_head import ParallelLMHead, is_deferred


def _hf_causal_lm_loss():
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):  # fmt: skip
    """HF's ForCausalLMLoss, fused when `logits` are a ParallelLMHead's deferred placeholder."""
    if not is_deferred(logits):
        return _hf_causal_lm_loss()(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                    ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)  # fmt: skip
    if vocab_size != logits.shape[-1]:
        raise ValueError(f"causal LM loss: vocab_size {vocab_size} is not the LM head's {logits.shape[-1]} outputs")
    if shift_labels is None:  # tokens < n predict n, as HF shifts them
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return ParallelLMHead.loss(logits, shift_labels, ignore_index=ignore_index, divisor=num_items_in_batch)


# -- which forwards are fused --------------------------------------------------------------------


def _self_attr(node, *path) -> bool:
    """Whether `node` is `self.<path...>`."""
    for name in reversed(path):
        if not (isinstance(node, ast.Attribute) and node.attr == name):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _config_none(test, model) -> bool:
    """Whether an if-test is `self.config.X is not None` (or `self.X is not None`) with X None now:
    a branch the forward never takes for this model."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)):
        return False
    right, left = test.comparators[0], test.left
    if not (isinstance(right, ast.Constant) and right.value is None and isinstance(left, ast.Attribute)):
        return False
    owner = getattr(model, "config", None) if _self_attr(left.value, "config") else model
    if not (_self_attr(left.value, "config") or _self_attr(left.value)):
        return False
    return hasattr(owner, left.attr) and getattr(owner, left.attr) is None


def _live(node, model):
    """Every AST node under `node`, without the bodies of branches never taken (`_config_none`)."""
    yield node
    for field, value in ast.iter_fields(node):
        if isinstance(node, ast.If) and field == "body" and _config_none(node.test, model):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield from _live(child, model)


def unfused_because(model, head) -> str | None:
    """None when `model`'s forward hands the output of `head` only to HF's ForCausalLMLoss (and
    to its output), else why its loss keeps the logits path."""
    if not isinstance(head, ParallelLMHead):
        return "its LM head is not a vocabulary-parallel head with gathered logits"
    if "_loss_function" in vars(model):
        return "it has its own loss_function"
    try:
        if type(model).loss_function is not None and model.loss_function is not _hf_causal_lm_loss():
            return f"its loss is {getattr(model.loss_function, '__name__', model.loss_function)}, not ForCausalLMLoss"
    except (ImportError, AttributeError):
        return "it has no HF loss_function"
    attr = next((n for n, m in model.named_children() if m is head), None)
    if attr is None:
        return "its LM head is not a direct child"
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return "its forward's source cannot be read"
    nodes = list(_live(fn, model))
    calls = [n for n in nodes if isinstance(n, ast.Call) and _self_attr(n.func, attr)]
    assigned = [n for n in nodes if isinstance(n, ast.Assign) and n.value in calls]
    if len(calls) != 1 or len(assigned) != 1 or not isinstance(assigned[0].targets[0], ast.Name):
        return f"its forward does not name the output of self.{attr}(...) once"
    name = assigned[0].targets[0].id
    allowed = set()  # the uses of `name` that pass it on untouched
    losses = 0
    for n in nodes:
        if isinstance(n, ast.Call):
            to_loss = _self_attr(n.func, "loss_function")
            losses += to_loss
            given = [k.value for k in n.keywords if k.arg == "logits"] + (n.args[:1] if to_loss else [])
            if to_loss or isinstance(n.func, ast.Name):  # the loss, or the output's constructor
                allowed.update(id(v) for v in given if isinstance(v, ast.Name) and v.id == name)
        elif isinstance(n, ast.Tuple):  # the output as a tuple (return_dict=False)
            allowed.update(id(v) for v in n.elts if isinstance(v, ast.Name) and v.id == name)
    uses = [n for n in nodes if isinstance(n, ast.Name) and n.id == name]
    other = [n.lineno for n in uses if id(n) not in allowed and not isinstance(n.ctx, ast.Store)]
    stores = [n for n in uses if isinstance(n.ctx, ast.Store)]
    if losses != 1:
        return f"its forward calls self.loss_function {losses} times"
    if len(stores) != 1 or other:
        return f"its forward does more with {name!r} than score it (line {(other or [stores[-1].lineno])[0]} of forward)"
    return None


# -- the hooks -------------------------------------------------------------------------------------


# Wrappers of a model's forward that pass its logits on untouched: accelerate's autocast and fp32
# conversion of 16-bit outputs (the placeholder is fp32), torch.autocast as a decorator.
_PASS_THROUGH = ("/accelerate/", "/torch/amp/", "/torch/utils/")


def _runs_class_forward(module) -> bool:
    """Whether calling `module` runs the forward `unfused_because` read: its class's, or that one
    inside wrappers known to pass the logits on. Another forward set on the instance (TRL's fused
    LM head, a user's patch) may read the logits itself: those get them."""
    forward = vars(module).get("forward")
    if forward is None:
        return True
    fn = getattr(forward, "__func__", forward)
    while fn is not None and fn is not type(module).forward:
        if type(fn).__module__.startswith("accelerate.") and hasattr(fn, "model_forward"):
            fn = fn.model_forward  # accelerate's ConvertOutputsToFp32
            continue
        code = getattr(fn, "__code__", None)
        if code is None or not any(part in code.co_filename for part in _PASS_THROUGH):
            return False
        fn = getattr(fn, "__wrapped__", None)
    return fn is not None


def _arm(module, args, kwargs):
    """Defer the head's logits for this forward if it is a training forward given labels, run by
    the forward that only scores them."""
    head = module.get_output_embeddings()
    if isinstance(head, ParallelLMHead):
        head.defer_logits = (module.training and kwargs.get("labels") is not None and installed(module)
                             and _runs_class_forward(module))  # fmt: skip


def _disarm(module, args, kwargs, output):
    """The head back to computing logits; the placeholder out of the output (None, as HF gives a
    loss computed without logits)."""
    head = module.get_output_embeddings()
    if isinstance(head, ParallelLMHead):
        head.defer_logits = False
    if hasattr(output, "keys") and is_deferred(output.get("logits")):
        output["logits"] = None
    elif isinstance(output, tuple) and any(is_deferred(t) for t in output):
        return tuple(None if is_deferred(t) else t for t in output)
    return output


def installed(model) -> bool:
    """Whether `model`'s training loss is fused (`install` found its forward plain)."""
    return vars(model).get("_loss_function") is causal_lm_loss


def install(model) -> str | None:
    """Fuse `model`'s training loss (see the module docstring) where its forward allows; returns
    None when installed, else why not (the model keeps its logits path)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    reason = unfused_because(model, head)
    if reason is None:
        model.loss_function = causal_lm_loss  # HF's setter: an instance attribute, kept by deepcopy / pickle
        model.register_forward_pre_hook(_arm, with_kwargs=True)
        model.register_forward_hook(_disarm, with_kwargs=True)
    return reason
