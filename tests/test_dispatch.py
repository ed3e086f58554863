"""The decode-path choice of every cache (`cache.dispatch`), checked on the CPU for the GPU a
user would have: `choose_implementation(..., platform=Platform(gpu=True, hopper=True))` names
the kernel the attend call would run there, or "reference", with the reason faster paths were
passed over."""

import logging

import jax
import jax.numpy as jnp
import pytest

from kvlowrank.bench.decode import BenchMethod, random_params
from kvlowrank.cache import dispatch
from kvlowrank.cache.base import init_caches
from kvlowrank.methods import (DenseSpec, EvictSpec, GearSpec, KiviSpec, PaluSpec,
                               RotatedSpec, XQuantCLSpec, XQuantSpec)
from kvlowrank.spec import ModelSpec

H100 = dispatch.Platform(gpu=True, hopper=True)
A100 = dispatch.Platform(gpu=True, hopper=False)
CPU = dispatch.Platform(gpu=False, hopper=False)
SPEC = ModelSpec(vocab_size=64, dim=256, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=128,
                 ffn_dim=256, max_seq_len=1024)
DECODE = (2, 1, 8, 128)


def _cache(name, mspec, spec=SPEC, dtype=jnp.bfloat16):
  params = random_params(spec, jax.random.key(0), BenchMethod(name, name, mspec))
  return init_caches(name, mspec, spec, params, batch=2, capacity=256, dtype=dtype)[0]


@pytest.mark.parametrize("name,mspec,platform,want,why", [
    ("dense", DenseSpec(), H100, "cudnn", None),
    ("dense", DenseSpec(implementation="triton"), H100, "triton", None),
    ("dense", DenseSpec(), CPU, "reference", "needs a GPU"),
    ("kivi", KiviSpec(bits=2, layout="warp"), H100, "mosaic", None),
    ("kivi", KiviSpec(bits=2, layout="warp"), A100, "reference", "warp layout"),
    ("kivi", KiviSpec(bits=2, layout="planar"), H100, "triton", "planar layout"),
    ("kivi", KiviSpec(bits=4), H100, "triton", "planar layout"),
    ("kivi", KiviSpec(bits=3), H100, "reference", "bits"),
    ("palu", PaluSpec(), H100, "mosaic", None),
    ("palu", PaluSpec(), A100, "triton", "needs a Hopper GPU"),
    ("palu", PaluSpec(bits=4), H100, "mosaic", None),
    ("palu", PaluSpec(bits=2), H100, "mosaic", None),
    ("palu", PaluSpec(bits=3), H100, "triton", "bits must be one of (2, 4)"),
    ("palu", PaluSpec(bits=4), A100, "triton", "needs a Hopper GPU"),
    ("palu", PaluSpec(implementation="reference"), H100, "reference", None),
    ("gear", GearSpec(), H100, "triton", "planar layout"),
    ("gear", GearSpec(sparsity=0.0), A100, "reference", "warp layout"),
    ("gear", GearSpec(sparsity=0.0), H100, "mosaic", None),
    ("gear", GearSpec(), CPU, "reference", "needs a GPU"),
    ("gear", GearSpec(sparsity=0.0, group_size=32), H100, "mosaic", None),
    ("gear", GearSpec(sparsity=0.0, group_size=32), A100, "reference", "warp layout"),
    ("gear", GearSpec(sparsity=0.0, group_size=32, layout="planar"), H100, "triton",
     "planar layout"),
    ("gear", GearSpec(group_size=32), H100, "triton", "planar layout"),
    ("fdc", RotatedSpec(), H100, "triton", None),
    ("zack", RotatedSpec(), H100, "triton", None),
    ("fdc", RotatedSpec(bits=4), H100, "triton", None),
    ("zack", RotatedSpec(bits=2), H100, "triton", None),
    ("zack", RotatedSpec(bits=4, group_size=8, residual=64), H100, "reference", "group_size"),
    ("fdc", RotatedSpec(bits=8), H100, "reference", "bits must be one of (2, 4)"),
    ("xquant", XQuantSpec(bits=2), H100, "xla", None),
    ("xquant", XQuantSpec(bits=2, implementation="triton"), H100, "triton", None),
    ("xquant", XQuantSpec(bits=2, implementation="auto"), CPU, "reference", "needs a GPU"),
    ("xquant_cl", XQuantCLSpec(bits=2), H100, "xla", None),
    ("xquant_cl", XQuantCLSpec(bits=2, implementation="triton"), H100, "xla", None),
    ("xquant_cl", XQuantCLSpec(bits=2, implementation="reference"), H100, "reference", None),
    ("evict", EvictSpec(inner="kivi", budget=128, inner_specs={"kivi": {"layout": "warp"}}),
     H100, "mosaic", None),
    ("evict", EvictSpec(inner="dense", budget=128), H100, "cudnn", None),
    ("evict", EvictSpec(inner="dense", budget=128), CPU, "reference", "needs a GPU"),
])
def test_decode_choice(name, mspec, platform, want, why):
  c = _cache(name, mspec)
  impl, reason = c.choose_implementation(DECODE, platform=platform)
  assert impl == want, reason
  if why is None:
    assert reason is None
  else:
    assert why in reason
  # Prefill (T > 1) always runs the reference: the kernels are decode kernels.
  impl, reason = c.choose_implementation((2, 16, 8, 128), platform=platform)
  assert impl == "reference" and (reason is None or "prefill" in reason)


def test_fallback_reasons_name_the_cause():
  assert "float32" in _cache("dense", DenseSpec(), dtype=jnp.float32).choose_implementation(
      DECODE, platform=H100)[1]
  assert "float32" in _cache("fdc", RotatedSpec(bits=4), dtype=jnp.float32).choose_implementation(
      DECODE, platform=H100)[1]
  window = _cache("dense", DenseSpec(), spec=SPEC.replace(sliding_window=64))
  assert "sliding" in window.choose_implementation(DECODE, platform=H100)[1]
  rope = _cache("palu", PaluSpec(), spec=SPEC.replace(rope_layout="interleaved"))
  impl, reason = rope.choose_implementation(DECODE, platform=H100)
  assert impl == "reference" and "interleaved RoPE" in reason


def test_bad_implementation_is_one_error_naming_the_field():
  with pytest.raises(ValueError, match="KiviSpec.implementation"):
    KiviSpec(implementation="cuda")
  with pytest.raises(ValueError, match="DenseSpec.implementation"):
    DenseSpec(implementation="mosaic")
  with pytest.raises(ValueError, match="PaluSpec.implementation"):
    PaluSpec(implementation="xla")


def test_reference_path_logs_its_reason_once(caplog):
  c = _cache("kivi", KiviSpec(bits=2))
  q = jnp.zeros(DECODE, jnp.bfloat16)
  pos = jnp.full((2, 1), 3, jnp.int32)
  dispatch._LOGGED.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.INFO, logger="kvlowrank.dispatch"):
    for _ in range(3):
      jax.jit(lambda c, q: c.attend(q, pos, {}, spec=SPEC))(c, q)
  msgs = [r.getMessage() for r in caplog.records if r.name == "kvlowrank.dispatch"]
  assert len(msgs) == 1 and "kivi attention runs reference" in msgs[0] and "GPU" in msgs[0]


@pytest.mark.parametrize("mspec,platform,want,why", [
    (KiviSpec(bits=2, layout="warp"), H100, "triton", None),
    (KiviSpec(bits=2, layout="warp", implementation="mosaic"), H100, "triton", None),
    (KiviSpec(bits=2, layout="warp"), dispatch.Platform(gpu=True, hopper=True, triton=False),
     "reference", "jax-triton"),
    (KiviSpec(bits=2, layout="warp", implementation="reference"), H100, "reference", None),
    (KiviSpec(bits=2, layout="warp", residual=0), H100, "reference", "residual 0"),
    (KiviSpec(bits=2, layout="planar"), H100, "triton", None),
    (KiviSpec(bits=4), H100, "triton", None),
    (KiviSpec(bits=4, v_bits=2, group_size=64), H100, "triton", None),
    (KiviSpec(bits=3), H100, "reference", "3-bit keys"),
    (KiviSpec(bits=4, v_bits=3), H100, "reference", "3-bit values"),
    (KiviSpec(bits=4, residual=0), H100, "reference", "residual 0"),
    (KiviSpec(bits=2, layout="warp"), CPU, "reference", None),
])
def test_kivi_decode_update_choice(mspec, platform, want, why):
  """A KIVI decode step's cache update: the fused Triton update where it fits (warp layout, or
  planar at 2/4/8 bits; R > 0, a GPU with jax-triton), else the jnp update with the reason."""
  impl, reason = _cache("kivi", mspec).update_implementation(platform=platform)
  assert impl == want, reason
  assert (reason is None) if why is None else (why in reason)
