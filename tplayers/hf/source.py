"""The source of the model code tplayers reads (a forward, to know the layout it computes), read once
per function: `inspect.getsource` reads and tokenizes the whole file at every call, and parallelize
asks about the same classes for every layer."""

import functools
import inspect


@functools.cache
def source(fn) -> str:
    """`fn`'s source, decorators unwrapped ("" where there is none to read)."""
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def forward_source(module) -> str:
    """The source of the module's forward ("" where it has none)."""
    return source(type(module).forward)


def same_forward(module, cls) -> bool:
    """Whether `module`'s forward is `cls`'s, line for line."""
    return bool(forward_source(module)) and forward_source(module) == source(cls.forward)
