"""Host-side planning of the Palu Mosaic GPU kernel (`mosaic_palu`): shape checks,
shared-memory budget and ring depths, split count, RoPE tables, query operand layout and
the partials' unpadding. Plain JAX, no Pallas: it runs (and is tested) on any machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import splitk
from .packed import PackedLatent
from .reference import rope_angles


T = 64          # tokens per tile (M of the key products)
RED_PER_COL = 32  # f32 cross-warp reduction scratch per compute warpgroup and score column
SMEM_LIMIT = 227 * 1024


def query_columns(qpk: int) -> int:
  """NP: score columns per KV head (its QPK query heads, zero-padded to 8 or 16)."""
  return 8 if qpk <= 8 else 16


def _smem_bytes(hpp, rk, rv, hh, np_, stages, v_stages):
  """Shared memory of the kernel's scratch buffers, each rounded up to 1 KiB as Pallas
  Mosaic GPU allocates them, plus the barriers."""
  kib = lambda n: -(-n // 1024) * 1024
  return (kib(hpp * 2 * rk * hh * 2)      # B_k column slices
          + kib(hpp * 2 * hh * np_ * 4)   # queries^T (f32, as loaded)
          + kib(hpp * 2 * np_ * hh * 2)   # rotated queries (fp16, rewritten per tile)
          + kib(T * 2 * hh * 2) + 1024    # in-tile cos/sin pairs; the exchange slot (1 KiB)
          + kib(stages * T * rk * 2)      # key latent ring
          + kib(stages * 2 * hh * 4)      # tile rotation rows
          + kib(v_stages * T * rv * 2)    # value latent ring
          + kib(hpp * np_ * T * 2)        # probabilities (transposed)
          + kib(hpp * RED_PER_COL * np_ * 4)  # reduction scratch
          + 256)                          # barriers (8 B each)


def check_inputs(hk, hv, k_bias) -> None:
  """ValueError naming the argument where the kernel cannot take it: a key bias, or a
  packed latent (both run on the triton implementation)."""
  if k_bias is not None:
    raise ValueError("mosaic latent attention: k_bias is not supported; use the triton "
                     "implementation")
  for name, x in (("hk", hk), ("hv", hv)):
    if isinstance(x, PackedLatent):
      raise ValueError(f"mosaic latent attention: {name} must be a bf16 array, not a "
                       "PackedLatent (packed latents run on the triton implementation)")


# Ring depths tried, deepest first, when `stages` / `v_stages` are not given.
AUTO_STAGES = ((2, 2), (1, 2), (2, 1), (1, 1))


def shares_values(hpp: int, rv: int) -> bool:
  """Whether the CTA's KV heads share the value product ("shared" values, see `plan`)."""
  return hpp >= 2 and rv % (64 * hpp) == 0


def plan(q_shape, hk_shape, hv_shape, bk_shape, *, heads_per_program=2, stages=None,
         v_stages=None, num_splits=None, target_programs=None):
  """Validates the shapes and knobs; returns the launch geometry (dict).

  The value product is picked here, not a knob: "shared" where `shares_values` holds (the
  heads_per_program KV heads of a CTA share the value latent: warpgroup w multiplies all
  their probabilities [T, hpp * NP] by its rv / hpp rows of the tile, the softmax rescales
  exchanged through shared memory; hpp times fewer narrow wgmmas per warpgroup), else
  "per-head" (each compute warpgroup multiplies its KV head's probabilities [T, NP] by the
  whole value-latent tile).
  stages / v_stages: key / value ring depths; None: the deepest that fit (AUTO_STAGES).
  """
  b, n, h = q_shape
  _, s, gr, rk = hk_shape
  rv = hv_shape[3]
  g = bk_shape[2] // h
  qpk = n // (gr * g)
  hh = h // 2
  if h != 128:
    raise ValueError(f"mosaic latent attention: head dim must be 128, got {h} (the per-tile "
                     "query rotation is a 64-row wgmma-layout array; use the triton "
                     "implementation)")
  for name, val in (("rk", rk), ("rv", rv)):
    if val % 64:
      raise ValueError(f"mosaic latent attention: {name} must be a multiple of 64, got {val}")
  if s % 8:
    raise ValueError(f"mosaic latent attention: the cache capacity (hk.shape[1] = {s}) must be "
                     "a multiple of 8 (TMA tiles of the latent rows)")
  if qpk > 16:
    raise ValueError(f"mosaic latent attention: at most 16 query heads per KV head, got {qpk}")
  np_ = query_columns(qpk)
  hpp = int(heads_per_program)
  if hpp < 1 or g % hpp:
    raise ValueError(f"mosaic latent attention: heads_per_program ({hpp}) must divide the "
                     f"group's KV heads ({g})")
  values = "shared" if shares_values(hpp, rv) else "per-head"
  if stages is not None and stages < 1:
    raise ValueError(f"mosaic latent attention: stages must be >= 1, got {stages}")
  if v_stages is not None and v_stages < 1:
    raise ValueError(f"mosaic latent attention: v_stages must be >= 1, got {v_stages}")
  if stages is None or v_stages is None:  # the deepest rings that fit (given ones kept)
    fitting = [(k, v) for k, v in AUTO_STAGES
               if (stages in (None, k) and v_stages in (None, v)
                   and _smem_bytes(hpp, rk, rv, hh, np_, k, v) <= SMEM_LIMIT)]
    stages, v_stages = fitting[0] if fitting else (stages or 1, v_stages or 1)
  need = _smem_bytes(hpp, rk, rv, hh, np_, stages, v_stages)
  if need > SMEM_LIMIT:
    raise ValueError(f"mosaic latent attention: heads_per_program={hpp}, stages={stages}, "
                     f"v_stages={v_stages} need "
                     f"{need} B of shared memory (rk={rk}, rv={rv}, H={h}); a block may use "
                     f"{SMEM_LIMIT}. Lower stages or heads_per_program.")
  parallel = b * gr * (g // hpp)
  if num_splits is None and target_programs is None:
    # One CTA per SM (the rings and operands take most of the shared memory): balance waves.
    ns = splitk.wave_balanced_splits(parallel, s, T, num_sms())
  else:
    ns = splitk.choose_num_splits(parallel, s, T, requested=num_splits,
                                  target=target_programs or 2 * 132)
  return dict(b=b, n=n, h=h, hh=hh, s=s, gr=gr, g=g, qpk=qpk, np=np_, rk=rk, rv=rv, hpp=hpp,
              stages=stages, v_stages=v_stages, values=values, num_splits=ns,
              grid=(parallel, ns))


def num_sms() -> int:
  """SMs of the first GPU (132 on H100/H200; also the value used where there is none, e.g.
  when lowering on a CPU machine)."""
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 132)) if dev.platform == "gpu" else 132


def rope_tables(inv_freq, capacity: int):
  """RoPE of token t0 + i (t0 a multiple of T) as R(t0) R(i), R(a) the rotation by a * w:
  returns cos, sin [T, H/2] float16 of fl(i * w) for the in-tile offsets i < T (resident
  in every CTA) and base [ceil(S / T), 2, H/2] float32: cos and sin of fl(t0 * w) per
  tile start (the reference's angle formula; fp16 cos/sin err <= 2**-12 absolute, below the
  bf16 rounding of the latents)."""
  ang = rope_angles(inv_freq, jnp.arange(T))
  base = rope_angles(inv_freq, jnp.arange(0, capacity, T))
  return (jnp.cos(ang).astype(jnp.float16), jnp.sin(ang).astype(jnp.float16),
          jnp.stack([jnp.cos(base), jnp.sin(base)], 1))


def query_operand(q, p, scale):
  """[B * Gr * g, 2, H/2, NP] float32: each KV head's queries, transposed (scaled by
  scale * log2 e, RoPE halves split, zero columns past QPK)."""
  b, n, h = q.shape
  kvh, qpk, hh, np_ = p["gr"] * p["g"], p["qpk"], p["hh"], p["np"]
  qf = q.astype(jnp.float32) * (scale * 1.4426950408889634)
  qf = qf.reshape(b * kvh, qpk, 2, hh).transpose(0, 2, 3, 1)
  return jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, np_ - qpk)))


def unpad_partials(o_t, lse_t, p):
  """Kernel partials -> [B, N, P, rv], [B, N, P]. values="per-head": [KVH, P, rv, NP] and
  [KVH, P, NP]; values="shared": per CTA (its hpp KV heads side by side in the columns)
  [KVH / hpp, P, rv, hpp * NP] and [KVH / hpp, P, hpp * NP]."""
  b, n, qpk, rv, ns, np_ = p["b"], p["n"], p["qpk"], p["rv"], p["num_splits"], p["np"]
  hpp = p["hpp"] if p["values"] == "shared" else 1
  kvc = p["gr"] * p["g"] // hpp  # per batch row: CTAs' head sets (per-head: KV heads)
  o = o_t.reshape(b, kvc, ns, rv, hpp, np_)[..., :qpk].transpose(0, 1, 4, 5, 2, 3)
  lse = lse_t.reshape(b, kvc, ns, hpp, np_)[..., :qpk].transpose(0, 1, 3, 4, 2)
  return o.reshape(b, n, ns, rv), lse.reshape(b, n, ns)
