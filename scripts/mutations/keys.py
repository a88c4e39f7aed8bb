"""What a mutation verdict is keyed by: the function it mutated, as code, not as bytes.

A verdict of the mutation job says what one mutant of one function did under the judge. It
stays true while that function's code is unchanged, whatever happens to the text around it: a
docstring reworded, a comment added, another function of the file rewritten. So the record keys
each mutant by its function, and a function by the hash of its code:

- a function's key is the sha256 of ``ast.dump`` of its ``def`` (decorators, arguments and their
  defaults, the body, nested functions) with every docstring removed; comments are not in the
  syntax tree, and ``ast.dump`` leaves out line numbers, so moving a function changes nothing;
- a method's name is ``Class.method``, a function's its own name, as mutmut names them;
- the rest of a file (imports, constants such as a strategy's thresholds, class statements other
  than methods) is one more key, :data:`MODULE`. When it changes, every function of the file
  goes pending with it: a constant can change what any function of its file computes.

A verdict stands while its own function is unchanged, even if a function it calls has changed.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

MODULE = "<module>"
"""The key of a file's code outside its functions and methods."""


def function_of(mutant: str) -> str:
    """The function of a mutmut name, as :func:`function_keys` names it:
    ``fovi_ref.segment_sum.x_segment_sum__mutmut_3`` is ``segment_sum`` and
    ``fovi_ref.knn_general.xǁGeneralOpsǁforward__mutmut_1`` is ``GeneralOps.forward``."""
    mangled = mutant.rpartition("__mutmut_")[0].rpartition(".")[2]
    if mangled.startswith("xǁ"):
        return ".".join(mangled.removeprefix("xǁ").split("ǁ"))
    return mangled.removeprefix("x_")


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of every module, class and function in it removed (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0].value if body and isinstance(body[0], ast.Expr) else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _digest(node: ast.AST) -> str:
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()


def function_keys(source: str) -> dict[str, str]:
    """``{function: sha256 of its code}`` for every top-level function and method of
    ``source`` (a module's text), and :data:`MODULE` for the rest of it."""
    tree = _without_docstrings(ast.parse(source))
    keys = {}
    rest = []  # the module without its functions and methods
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            keys[node.name] = _digest(node)
        elif isinstance(node, ast.ClassDef):
            methods = [
                n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            for method in methods:
                keys[f"{node.name}.{method.name}"] = _digest(method)
            others = [n for n in node.body if n not in methods]
            bare = ast.ClassDef(
                name=node.name,
                bases=node.bases,
                keywords=node.keywords,
                body=others,
                decorator_list=node.decorator_list,
                type_params=getattr(node, "type_params", []),
            )
            rest.append(bare)
        else:
            rest.append(node)
    keys[MODULE] = _digest(ast.Module(body=rest, type_ignores=[]))
    return keys


def file_keys(path: Path) -> dict[str, str]:
    """:func:`function_keys` of the file at ``path``."""
    return function_keys(path.read_text())
