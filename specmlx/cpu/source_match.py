"""Which of mlx-lm's classes a native patch may take, by the code of their __call__, and
the one subclass each such class gets.

A patch that replaces a layer's __call__ by a native op is only right where that
__call__ computes what the op does. specmlx keeps mlx-lm's code that each op stands for
verbatim (specmlx.cpu.attention, blocks, mlp, qkv) and compares it with the
class's source as syntax trees, so that a change to mlx-lm's code can only turn an op
off, never make it compute something else.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable


def call_tree(cls: type) -> ast.Module | None:
    """The syntax tree of cls.__call__'s source, or None where it has none to read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, SyntaxError):
        return None


def call_body(cls: type, params: list[str]) -> list[str] | None:
    """The statements of cls.__call__ (its docstring left out), each as its syntax tree's
    dump, where its parameters are `params`; None where they are not, or there is no
    source. Comments, layout and docstrings do not count: a body matches a kept copy of
    mlx-lm's source when the code is the same."""
    tree = call_tree(cls)
    fn = tree.body[0] if tree is not None and tree.body else None
    if not isinstance(fn, ast.FunctionDef) or [a.arg for a in fn.args.args] != params:
        return None
    return [
        ast.dump(stmt)
        for stmt in fn.body
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
    ]


def mixed_class(
    memo: dict[type, type | None], cls: type, mixin: type, prefix: str, attrs: Callable
) -> type | None:
    """cls with `mixin` before it in its bases, named prefix + cls's name and given the
    class attributes attrs(cls) returns, or None where that is None; made once per class
    and kept in `memo` (one subclass per class, however many layers are patched). It keeps
    cls's module: the architecture's, whose functions (its attention) the patches route."""
    if cls not in memo:
        found = attrs(cls)
        if found is None:
            memo[cls] = None
        else:
            namespace = {"__module__": cls.__module__, **found}
            memo[cls] = type(prefix + cls.__name__, (mixin, cls), namespace)
    return memo[cls]
