"""kvlowrank: KV-cache compression along the hidden dimension, in JAX."""

__version__ = "0.1.0"

from kvlowrank.spec import ModelSpec, RopeScaling


_API = ("load", "compress", "CompressedModel")


def __getattr__(name):
  """The one-call API (kvlowrank.api: load, compress, CompressedModel), imported on first
  use so that `import kvlowrank` stays light."""
  if name in _API:
    from kvlowrank import api  # pylint: disable=import-outside-toplevel
    return getattr(api, name)
  raise AttributeError(f"module 'kvlowrank' has no attribute {name!r}")
