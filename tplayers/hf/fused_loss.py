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

Only a forward read to do nothing else with the logits is fused (`read_forward`, once): the head
called once, its result named, that name only scaled by numbers of the model or its config and
passed through tanh on the way (Gemma 2's final logit softcap: / cap, tanh, * cap; Cohere's
logit_scale; Granite's logits_scaling: the fused loss applies the same steps to each chunk, in the
same dtype), and used only as the loss function's logits and in the output. A branch on a config
value's `is not None` is read as this model takes it, and checked again at every forward. Any
other use, a custom `loss_function`, or a loss type other than ForCausalLM keeps the logits path,
unchanged. The placeholder refuses any use it was not told of, loudly: never silently wrong.
"""

import ast
import contextlib
import inspect
import textwrap
from dataclasses import dataclass

import torch.nn.functional as F

from tplayers.nn.lm_head import ParallelLMHead, is_deferred, is_scored


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


def _config_test(test, model):
    """For an if-test `self.config.X is not None` (or `self.X is not None`): ((owner, X), whether X is
    None now), the branch the forward takes for this model; else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)):
        return None
    right, left = test.comparators[0], test.left
    if not (isinstance(right, ast.Constant) and right.value is None and isinstance(left, ast.Attribute)):
        return None
    owner = "config" if _self_attr(left.value, "config") else "self" if _self_attr(left.value) else None
    if owner is None or not hasattr(_owner(model, owner), left.attr):
        return None
    return (owner, left.attr), getattr(_owner(model, owner), left.attr) is None


def _owner(model, owner):
    return getattr(model, "config", None) if owner == "config" else model


@dataclass(frozen=True)
class ForwardReading:
    """What the forward does with the head's output, for this model: the transforms on the way to
    the loss, in order ((op, owner, attribute) or ("tanh", None, None)), and the config values its
    branches were read under ((owner, attribute), None or not)."""

    transforms: tuple = ()
    branches: tuple = ()

    def resolve(self, model):
        """The transforms with their numbers, as `ParallelLMHead.logit_transforms` takes them, or
        None where the model no longer is what was read (a branch would go the other way, a scale
        is not a number)."""
        if any((getattr(_owner(model, owner), attr, None) is None) != none for (owner, attr), none in self.branches):
            return None
        out = []
        for op, owner, attr in self.transforms:
            value = None if op == "tanh" else getattr(_owner(model, owner), attr, None)
            if op != "tanh" and (isinstance(value, bool) or not isinstance(value, int | float)):
                return None
            out.append((op, value))
        return tuple(out)


def _statements(body, model, unconditional, branches):
    """(statement, whether it always runs) for every statement, in order, without branches never taken
    for this model (a config value's `is not None`); the tests read go to `branches`."""
    for stmt in body:
        yield stmt, unconditional
        read = _config_test(stmt.test, model) if isinstance(stmt, ast.If) else None
        if read is not None:
            branches.append(read)
            yield from _statements(stmt.orelse if read[1] else stmt.body, model, unconditional, branches)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if inner:
                yield from _statements(inner, model, False, branches)


def _unwrapped(node):
    """`x` of `x.float()` / `x.contiguous()` (chained too): calls the placeholder passes through."""
    while (isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute)
           and node.func.attr in ("float", "contiguous")):  # fmt: skip
        node = node.func.value
    return node


def _own_nodes(stmt):
    """`stmt` and the expressions in it, not the statements nested in it (`_statements` gives those)."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt | ast.excepthandler))


def _transform(stmt, name):
    """(op, owner, attribute) of `name = name * self.config.X` / `name / ...` / `X * name` /
    `torch.tanh(name)` / `name.tanh()`; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == name):  # fmt: skip
        return None
    value, is_name = stmt.value, lambda n: isinstance(n, ast.Name) and n.id == name

    def scalar(n):
        if isinstance(n, ast.Attribute) and (_self_attr(n.value, "config") or _self_attr(n.value)):
            return ("config" if _self_attr(n.value, "config") else "self"), n.attr
        return None

    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult | ast.Div):
        op = "mul" if isinstance(value.op, ast.Mult) else "div"
        if is_name(value.left) and scalar(value.right):
            return (op, *scalar(value.right))
        if op == "mul" and is_name(value.right) and scalar(value.left):
            return (op, *scalar(value.left))
    if isinstance(value, ast.Call) and not value.keywords:
        f = value.func
        torch_tanh = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch"
        if torch_tanh and f.attr == "tanh" and len(value.args) == 1 and is_name(value.args[0]):
            return ("tanh", None, None)
        if isinstance(f, ast.Attribute) and f.attr == "tanh" and is_name(f.value) and not value.args:
            return ("tanh", None, None)
    return None


def read_forward(model, head) -> "ForwardReading | str":
    """How `model`'s forward takes the output of `head` to HF's ForCausalLMLoss: it names that output
    once, transforms it only by scales and tanh, and uses it only as the loss function's logits and
    in its output. A ForwardReading, else why its loss keeps the logits path."""
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
    branches = []
    statements = list(_statements(fn.body, model, True, branches))
    nodes = [n for stmt, _ in statements for n in _own_nodes(stmt)]
    calls = [n for n in nodes if isinstance(n, ast.Call) and _self_attr(n.func, attr)]
    assigned = [n for n in nodes if isinstance(n, ast.Assign) and _unwrapped(n.value) in calls]
    if len(calls) != 1 or len(assigned) != 1 or not isinstance(assigned[0].targets[0], ast.Name):
        return f"its forward does not name the output of self.{attr}(...) once"
    name = assigned[0].targets[0].id
    allowed = set()  # the uses of `name` that pass it on untouched, or transform it as the loss can
    losses, transforms = 0, []
    for stmt, always in statements:
        step = _transform(stmt, name)
        if step is not None:
            if not always:
                return f"its forward transforms {name!r} under a condition (line {stmt.lineno} of forward)"
            transforms.append(step)
            allowed.update(id(n) for n in _own_nodes(stmt))
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
    stores = [n for n in uses if isinstance(n.ctx, ast.Store) and id(n) not in allowed]
    if losses != 1:
        return f"its forward calls self.loss_function {losses} times"
    if len(stores) != 1 or other:
        return (
            f"its forward does more with {name!r} than score it (line {(other or [stores[-1].lineno])[0]} of forward)"
        )
    reading = ForwardReading(tuple(transforms), tuple(branches))
    if reading.resolve(model) is None:
        return f"its logits are scaled by something other than a number ({transforms})"
    return reading


def unfused_because(model, head) -> str | None:
    """None when `model`'s training loss can be fused (`read_forward`), else why it keeps the logits path."""
    reading = read_forward(model, head)
    return reading if isinstance(reading, str) else None


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
    if not isinstance(head, ParallelLMHead):
        return
    transforms = None
    if module.training and kwargs.get("labels") is not None and installed(module) and _runs_class_forward(module):
        reading = head.forward_reading
        transforms = reading.resolve(module) if reading is not None else None  # None: the model changed
    head.defer_logits = transforms is not None
    head.logit_transforms = transforms or ()


def _disarm(module, args, kwargs, output):
    """The head back to computing logits; a scored placeholder out of the output (None, as HF gives
    a loss computed without logits)."""
    head = module.get_output_embeddings()
    if isinstance(head, ParallelLMHead):
        head.defer_logits, head.logit_transforms = False, ()
    if hasattr(output, "keys") and is_scored(output.get("logits")):
        output["logits"] = None
    elif isinstance(output, tuple) and any(is_scored(t) for t in output):
        return tuple(None if is_scored(t) else t for t in output)
    return output  # a placeholder not scored yet is for a later hook (context parallelism's loss)


def installed(model) -> bool:
    """Whether `model`'s training loss is fused (`install` found its forward plain)."""
    return vars(model).get("_loss_function") is causal_lm_loss


@contextlib.contextmanager
def logits_computed(model):
    """The training forwards of `model` (or of the HF model inside it) compute the logits, the loss
    from them by HF's own function: the self-check's logits of the step it checked (an encoder-
    decoder's decoder inputs made from the labels as there)."""
    fused = [m for m in model.modules() if installed(m)]  # the HF model inside a peft model too
    for m in fused:
        del vars(m)["_loss_function"]
    try:
        yield
    finally:
        for m in fused:
            vars(m)["_loss_function"] = causal_lm_loss


def install(model) -> str | None:
    """Fuse `model`'s training loss (see the module docstring) where its forward allows; returns
    None when installed, else why not (the model keeps its logits path)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    reading = read_forward(model, head)
    if isinstance(reading, str):
        return reading
    model.loss_function = causal_lm_loss  # HF's setter: an instance attribute, kept by deepcopy / pickle
    head.forward_reading = reading  # checked again at each forward against the model's config
    model.register_forward_pre_hook(_arm, with_kwargs=True)
    model.register_forward_hook(_disarm, with_kwargs=True)
    return None
