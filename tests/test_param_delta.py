"""Delta checkpoints of calibrated params: only changed entries are stored, and
re-applying them to the loaded model rebuilds the calibrated pytree bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ckpt
from kvlowrank.experiment import param_delta


def _base():
  rng = np.random.default_rng(0)
  layer = lambda: {n: jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
                   for n in ("wq", "wk", "wv", "wo")}
  return {"embed": jnp.asarray(rng.normal(size=(10, 4)), jnp.float32),
          "layers": [layer(), layer()]}


def _calibrated(base):
  layers = []
  for i, lp in enumerate(base["layers"]):
    lp = dict(lp)
    lp["wo"] = lp["wo"] * 2.0                       # changed
    lp["palu"] = {"a": jnp.full((4, 2), float(i)), "ranks": jnp.arange(3)}  # added
    del lp["wv"]                                    # removed
    layers.append(lp)
  return {"embed": base["embed"], "layers": layers}


def test_delta_round_trip_through_orbax_is_bitwise(tmp_path):
  base = _base()
  new = _calibrated(base)
  changed, removed = param_delta.diff(base, new)
  assert sorted(changed) == sorted(
      [f"layers/{i}/{k}" for i in range(2) for k in ("wo", "palu/a", "palu/ranks")])
  assert sorted(removed) == [["layers", 0, "wv"], ["layers", 1, "wv"]]
  path = ckpt.save(tmp_path / "d", list(changed.values()),
                   {"changed": list(changed), "removed": removed})
  arrays, meta = ckpt.restore(path)
  rebuilt = param_delta.apply(base, dict(zip(meta["changed"], arrays)),
                              [list(p) for p in meta["removed"]])
  assert "wv" in base["layers"][0], "apply must not mutate the loaded params"
  flat = lambda t: {k: np.asarray(v) for k, v in _flatten(t)}
  a, b = flat(new), flat(rebuilt)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
  # Negative control: without the delta, the rebuilt tree is the uncalibrated one.
  assert not np.array_equal(np.asarray(param_delta.apply(base, {}, [])["layers"][0]["wo"]),
                            a["layers/0/wo"])


def test_unchanged_params_give_an_empty_delta_and_structure_changes_fail():
  base = _base()
  assert param_delta.diff(base, base) == ({}, [])
  bad = dict(base, layers=base["layers"][:1])
  with pytest.raises(ValueError, match="structure"):
    param_delta.diff(base, bad)


def _flatten(t, prefix=""):
  if isinstance(t, dict):
    for k, v in t.items():
      yield from _flatten(v, f"{prefix}{k}/")
  elif isinstance(t, (list, tuple)):
    for i, v in enumerate(t):
      yield from _flatten(v, f"{prefix}{i}/")
  else:
    yield prefix[:-1], t
