"""Render chat `messages` with a checkpoint's chat template, as `transformers` does.

Same Jinja settings as `transformers` (`apply_chat_template`): a sandboxed environment with
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text, and the
`raise_exception` and `strftime_now` helpers; special tokens from `tokenizer_config.json` are
passed in by name, and the generation prompt is added because a served request ends with it.
"""
from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

from ..core.errors import BadInput


def chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The default template: `chat_template` of tokenizer_config.json, else chat_template.jinja."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = model_dir / "chat_template.jinja"
    return path.read_text() if path.is_file() else None


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise BadInput(f"the chat template does not parse (line {exc.lineno}): {exc.message}") from None


def _special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def render_chat(model_dir: Path, tokenizer_config: dict[str, Any], messages: Any, where: str) -> str:
    import jinja2

    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadInput(f"{where}: messages must be a list of objects with a 'role'")
    template = chat_template(model_dir, tokenizer_config)
    if template is None:
        raise BadInput(f"{where}: chat messages need a chat template, and {model_dir} has none "
                       f"(tokenizer_config.json chat_template or chat_template.jinja)")
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=True, tools=None,
                                          documents=None, **_special_tokens(tokenizer_config))
    except jinja2.exceptions.TemplateError as exc:
        raise BadInput(f"{where}: the chat template failed: {exc}") from None
