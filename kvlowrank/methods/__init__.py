"""Evaluable KV-cache methods (see kvlowrank.methods.registry for the contract).

Importing this package registers the built-in methods; a new method adds its module
to the imports below.
"""

from kvlowrank.methods.registry import (Method, dense_kv_bytes_per_token, get_method, methods,
                                        register_method)
from kvlowrank.methods import dense as _dense  # noqa: F401  (registers "dense")
from kvlowrank.methods import kivi as _kivi  # noqa: F401  (registers "kivi")
from kvlowrank.methods import palu as _palu  # noqa: F401  (registers "palu")
from kvlowrank.methods import xquant as _xquant  # noqa: F401  (registers "xquant", "xquant_cl")
