"""`Nitro(...)`'s signature and the run-keyword section of its docstring, generated from
`RUN_KEYWORDS` and `KEYWORD_ONLY`: `help(nitro.Nitro)`, `inspect.signature(nitro.Nitro)` and
editors show every keyword with its default and doc, and a new keyword appears there by itself.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS

__all__ = ["keyword_signature", "keywords_doc"]


class _Shown:
    """A default as the signature shows it: `0`, `'auto'`, or `jax.device_count()` for one
    computed when a run resolves it."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parameters() -> list[inspect.Parameter]:
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        inspect.Parameter(name, keyword, default=_Shown(run_keyword.default_text))
        for name, run_keyword in RUN_KEYWORDS.items()
    ]
    parameters += [inspect.Parameter(name, keyword, default=None) for name in KEYWORD_ONLY]
    return parameters


def keyword_signature(init: Callable[..., Any]) -> inspect.Signature:
    """`init`'s signature with `**keywords` spelled out: one keyword-only parameter per run
    keyword, with its default."""
    signature = inspect.signature(init, eval_str=True)
    named = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    return signature.replace(parameters=named + _parameters())


def _entry(name: str, default: str, doc: str) -> str:
    body = textwrap.fill(
        doc, width=92, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False
    )
    return f"{name}={default}\n{body}"


def keywords_doc() -> str:
    """The docstring section listing every run keyword: `name=default` and its doc."""
    run = "\n".join(_entry(name, k.default_text, k.doc) for name, k in RUN_KEYWORDS.items())
    only = "\n".join(_entry(name, "None", doc) for name, doc in KEYWORD_ONLY.items())
    order = textwrap.fill(
        "Run keywords. Each resolves from the keyword given here, else a method of the same "
        "name on the experiment (called with no arguments), else a Host field of the same "
        "name, else the default shown:",
        width=96,
    )
    return (
        f"{order}\n\n{textwrap.indent(run, '  ')}\n\n"
        "Given here only (no method or field supplies them):\n\n"
        f"{textwrap.indent(only, '  ')}\n"
    )
