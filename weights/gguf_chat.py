"""A GGUF file's chat template (`tokenizer.chat_template`) rendered with Jinja2 as transformers renders templates
(its chat_template_utils): sandboxed, trim_blocks and lstrip_blocks, loop controls, its `tojson`, `raise_exception`
and `strftime_now`."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


def render_chat(template: str, **variables: Any) -> str:
    """The template's text for `variables` (messages, add_generation_prompt, bos_token...)."""
    return _compiled(template).render(**variables)


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)
