"""Render chat `messages` with a checkpoint's chat template, as `transformers` does.

Same Jinja settings as `transformers` (`apply_chat_template`): a sandboxed environment with
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text, and the
`raise_exception` and `strftime_now` helpers; special tokens from `tokenizer_config.json` are
passed in by name, and the generation prompt is added because a served request ends with it.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import json
import select
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

from ..core.errors import BadInput
from ..core.fileio import read_bounded

# Limits of one render: a template is code from the checkpoint, so it runs in a worker process
# with its own memory cap, is killed past its time, and may not write more than its output cap.
RENDER_SECONDS = 10.0
RENDER_MEMORY_BYTES = 512 << 20
MAX_OUTPUT_CHARS = 16 << 20
MAX_TEMPLATE_BYTES = 4 << 20


def chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The default template: `chat_template` of tokenizer_config.json, else chat_template.jinja."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = model_dir / "chat_template.jinja"
    if not path.exists():
        return None
    try:
        return read_bounded(path, MAX_TEMPLATE_BYTES, "chat template").decode()
    except UnicodeDecodeError:
        raise BadInput(f"{path} is not UTF-8 text") from None


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
    """The chat template rendered for `messages`, in a worker process under RENDER_SECONDS,
    RENDER_MEMORY_BYTES and MAX_OUTPUT_CHARS; every failure is BadInput naming `where`."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadInput(f"{where}: messages must be a list of objects with a 'role'")
    template = chat_template(model_dir, tokenizer_config)
    if template is None:
        raise BadInput(f"{where}: chat messages need a chat template, and {model_dir} has none "
                       f"(tokenizer_config.json chat_template or chat_template.jinja)")
    key = (template, tuple(sorted(_special_tokens(tokenizer_config).items())))
    renderer = _renderers.get(key)
    if renderer is None or not renderer.alive:
        for old in _renderers.values():
            old.close()
        _renderers.clear()
        renderer = _renderers[key] = _Renderer(template, dict(key[1]))
    return renderer.render(messages, where)


# --- The worker ---------------------------------------------------------------------------------------

def _send(stream: BinaryIO, message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    prefix = stream.read(8)
    if len(prefix) < 8:
        return None
    return json.loads(stream.read(struct.unpack("<Q", prefix)[0]))


def _render_limited(template: Any, messages: list[Any], specials: dict[str, str]) -> str:
    pieces, length = [], 0
    for piece in template.generate(messages=messages, add_generation_prompt=True, tools=None,
                                   documents=None, **specials):
        pieces.append(piece)
        length += len(piece)
        if length > MAX_OUTPUT_CHARS:
            raise OverflowError(f"its output passed {MAX_OUTPUT_CHARS:,} characters")
    return "".join(pieces)


def _serve() -> None:
    """The worker's loop: compile the template it is sent, then render each message list."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY_BYTES, RENDER_MEMORY_BYTES))
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    setup = _receive(requests)
    try:
        template = _compiled(setup["template"])
    except BadInput as exc:
        _send(replies, {"error": str(exc)})
        return
    _send(replies, {"ready": True})
    while (messages := _receive(requests)) is not None:
        try:
            reply = {"text": _render_limited(template, messages, setup["specials"])}
        except MemoryError:
            reply = {"error": f"the chat template failed: it needs more than {RENDER_MEMORY_BYTES >> 20} MiB"}
        except RecursionError:
            reply = {"error": "the chat template failed: it recurses too deep"}
        except Exception as exc:  # any error of the template, the sandbox or a filter
            text = " ".join(str(exc).split())[:300]
            reply = {"error": f"the chat template failed: {type(exc).__name__}: {text}"}
        _send(replies, reply)


class _Renderer:
    """A worker process rendering one template; killed and replaced when a render runs too long."""

    def __init__(self, template: str, specials: dict[str, str]):
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _send(self.process.stdin, {"template": template, "specials": specials})
        reply = self._reply("the chat template")
        if "error" in reply:
            self.close()
            raise BadInput(reply["error"])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def _reply(self, where: str) -> dict[str, Any]:
        stream = self.process.stdout
        if not select.select([stream], [], [], RENDER_SECONDS)[0]:
            self.close()
            raise BadInput(f"{where}: the chat template ran longer than {RENDER_SECONDS:g} s; refused")
        try:
            reply = _receive(stream)
        except (ValueError, OSError):
            reply = None
        if not isinstance(reply, dict):
            self.close()
            raise BadInput(f"{where}: the chat template's renderer stopped (exit {self.process.returncode})")
        return reply

    def render(self, messages: list[Any], where: str) -> str:
        try:
            _send(self.process.stdin, messages)
        except (BrokenPipeError, OSError):
            self.close()
            raise BadInput(f"{where}: the chat template's renderer stopped") from None
        reply = self._reply(where)
        if "error" in reply:
            raise BadInput(f"{where}: {reply['error']}")
        return reply["text"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()


_renderers: dict[tuple[str, tuple[tuple[str, str], ...]], _Renderer] = {}


@atexit.register
def _close_renderers() -> None:
    for renderer in _renderers.values():
        renderer.close()


if __name__ == "__main__":
    _serve()
