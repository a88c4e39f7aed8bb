"""What a mutation verdict is keyed by: the function it mutated, as code, not as bytes.

A verdict of the mutation job says what one mutant of one function did under the judge. It
stays true while that function's code is unchanged, whatever happens to the text around it: a
docstring reworded, a comment added, another function of the file rewritten. So the record keys
each mutant by its function, and a function by the hash of its code:

- a function's key is the sha256 of ``ast.dump`` of its ``def`` (decorators, arguments and their
  defaults, the body, nested functions) with every docstring removed, and of the imports of the
  names it uses; comments are not in the syntax tree, and ``ast.dump`` leaves out line numbers,
  so moving a function changes nothing;
- a method's name is ``Class.method``, a function's its own name, as mutmut names them;
- the rest of a file (constants such as a strategy's thresholds, ``from __future__``, class
  statements other than methods, and the imports of the names they use) is one more key,
  :data:`MODULE`. When it changes, every function of the file goes pending with it: a constant
  can change what any function of its file computes.

**Imports are keyed where they are used.** An import binds names; a function can only be changed
by the bindings of the names it reads. So each import is part of the key of every function (and
of the module code) that reads a name it binds, and of no other: importing one more helper for
one function leaves the file's other verdicts standing, while re-pointing a name pends every
function that reads it.

A verdict stands while its own function is unchanged, even if a function it calls has changed.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

MODULE = "<module>"
"""The key of a file's code outside its functions and methods."""

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


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
        if isinstance(node, (ast.Module, ast.ClassDef, *FUNCTIONS)):
            body = node.body
            first = body[0].value if body and isinstance(body[0], ast.Expr) else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def import_bindings(tree: ast.Module) -> dict[str, str]:
    """``{name: the import that binds it}`` for the module-level imports of ``tree`` (not
    ``from __future__``, which is module code): ``from a import b as c`` binds ``c``,
    ``import a.b`` binds ``a``."""
    bindings: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                source = f"from {'.' * node.level}{node.module} import {alias.name}"
                bindings.setdefault(alias.asname or alias.name, []).append(source)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.partition(".")[0]
                bindings.setdefault(name, []).append(f"import {alias.name}")
    return {name: "; ".join(sources) for name, sources in bindings.items()}


def _is_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.Import) or (
        isinstance(node, ast.ImportFrom) and node.module != "__future__"
    )


def _digest(nodes: list[ast.AST], bindings: dict[str, str]) -> str:
    """sha256 of the nodes' ``ast.dump`` and of the imports of the names they read."""
    read = {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}
    imports = [f"{name}={bindings[name]}" for name in sorted(read & set(bindings))]
    text = "\n".join([*(ast.dump(node) for node in nodes), *imports])
    return hashlib.sha256(text.encode()).hexdigest()


def function_keys(source: str) -> dict[str, str]:
    """``{function: sha256 of its code}`` for every top-level function and method of
    ``source`` (a module's text), and :data:`MODULE` for the rest of it."""
    tree = _without_docstrings(ast.parse(source))
    bindings = import_bindings(tree)
    keys = {}
    rest = []  # the module without its functions, methods and imports
    for node in tree.body:
        if isinstance(node, FUNCTIONS):
            keys[node.name] = _digest([node], bindings)
        elif isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, FUNCTIONS)]
            for method in methods:
                keys[f"{node.name}.{method.name}"] = _digest([method], bindings)
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
        elif not _is_import(node):
            rest.append(node)
    keys[MODULE] = _digest(rest, bindings)
    return keys


def file_keys(path: Path) -> dict[str, str]:
    """:func:`function_keys` of the file at ``path``."""
    return function_keys(path.read_text())
