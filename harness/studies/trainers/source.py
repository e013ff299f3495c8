"""A place in a trainer's installed source: the file, the function, the line.

A cause the study names points at the line that makes it, found in the installed package
at run time (by the function's name and a fragment of the line's text), not a line number
written down once: where a version moves or rewrites it, the row says so instead of
pointing at the wrong line.
"""

from __future__ import annotations

import ast
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """``text`` on a line of ``function`` (a qualified name: ``Class.method``) in ``file``,
    a path inside the installed ``distribution``."""

    distribution: str
    file: str
    function: str
    text: str

    def __post_init__(self) -> None:
        if not (self.distribution and self.file.endswith(".py") and self.function
                and self.text):
            raise ValueError(f"{self}: a distribution, a .py file, a function and a line's "
                             "text are all needed")

    def located(self, site: Path | None = None) -> str:
        """``recipes/full_finetune_single_device.py:693, FullFinetuneRecipeSingleDevice.train``
        as installed (here, or in ``site``: the folder another environment installs its
        packages in); where the file, the function or the line is not there, what is
        missing."""
        where = f"{self.file}, {self.function}"
        try:
            path = site / self.file if site is not None else Path(str(
                importlib.metadata.distribution(self.distribution).locate_file(self.file)))
            lines = path.read_text().splitlines()
        except (importlib.metadata.PackageNotFoundError, OSError):
            return f"{where} (not installed)"
        span = _function_lines(ast.parse("\n".join(lines)), self.function.split("."))
        if span is None:
            return f"{where} (no such function in this version)"
        first, last = span
        for number in range(first, last + 1):
            if self.text in lines[number - 1]:
                return f"{self.file}:{number}, {self.function}"
        return f"{where} (the line `{self.text}` is not in this version)"


def _function_lines(tree: ast.AST, names: list[str]) -> tuple[int, int] | None:
    """The first and last line of the function (or class) ``names`` leads to, from the
    module's top level down, or None."""
    node: ast.AST = tree
    for name in names:
        found = [child for child in ast.iter_child_nodes(node)
                 if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                 and child.name == name]
        if not found:
            return None
        node = found[0]
    return node.lineno, node.end_lineno or node.lineno
