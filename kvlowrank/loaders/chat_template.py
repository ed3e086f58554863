"""Rendering a model's Jinja chat template the way HF transformers does."""

from __future__ import annotations

import datetime
import functools
import json
from typing import Optional, Sequence


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError as e:  # jinja2 is optional: only chat formatting needs it
    raise ImportError("apply_chat_template needs jinja2: pip install jinja2") from e

  def raise_exception(message):
    raise ValueError(f"chat template error: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  # Same environment options as HF transformers' `_compile_jinja_template`, so that
  # whitespace handling (trim_blocks / lstrip_blocks) renders identically.
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def render_chat_template(template: Optional[str], messages: Sequence[dict], *,
                         add_generation_prompt: bool, bos_token: Optional[str],
                         eos_token: Optional[str], source: str) -> str:
  """Formats chat `messages` ([{"role", "content"}, ...]) into a prompt string.

  Args:
    template: the Jinja template (None: the model has none).
    messages: the conversation.
    add_generation_prompt: append the assistant turn header.
    bos_token, eos_token: strings the template may reference.
    source: checkpoint path, for error messages.
  Returns:
    The rendered prompt (tokenize it with `encode(..., add_bos=False)` when the
    template already writes the BOS token).
  """
  if not template:
    raise ValueError(f"{source}: the tokenizer has no chat template")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
  return _compile(template).render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token or "", eos_token=eos_token or "")
