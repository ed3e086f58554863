"""Host-side planning of the Palu Mosaic GPU kernel (`mosaic_palu`): shape checks,
shared-memory budget and ring depths, split count, RoPE tables, query operand layout and
the partials' unpadding. Plain JAX, no Pallas: it runs (and is tested) on any machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..common import splitk
from .packed import PackedLatent
from .reference import rope_angles


T = 64          # tokens per tile (M of the key products)
RED_PER_COL = 32  # f32 cross-warp reduction scratch per compute warpgroup and score column
SMEM_LIMIT = 227 * 1024


def query_columns(qpk: int) -> int:
  """NP: score columns per KV head (its QPK query heads, zero-padded to 8 or 16)."""
  return 8 if qpk <= 8 else 16


def _smem_bytes(hpp, rk, rv, hh, np_, stages, v_stages, bits=None, gr=1, c_stages=0):
  """Shared memory of the kernel's scratch buffers, each rounded up to 1 KiB as Pallas
  Mosaic GPU allocates them, plus the barriers. Packed latents (bits set) add the key code
  ring (c_stages slots of code tiles and scale/zero rows), the value code slot beyond
  the cos/sin table it aliases, the value and key tiles' float32 scale/zero rows (a
  v_stages and a stages ring) and each head's 1^T B_k."""
  kib = lambda n: -(-n // 1024) * 1024
  codes = 0
  if bits is not None:  # key code ring; the value code slot shares the cos/sin table's memory
    union = kib(kib(T * rv * bits // 8) + 2 * T * gr * 2)
    codes = (kib(c_stages * T * rk * bits // 8) + kib(c_stages * 2 * T * gr * 2)
             + max(0, union - kib(T * 2 * hh * 2)) + kib(v_stages * 2 * T * 4)
             + kib(stages * 2 * T * 4) + kib(hpp * 2 * hh * 4))
  return (codes
          + kib(hpp * 2 * rk * hh * 2)      # B_k column slices
          + kib(hpp * 2 * hh * np_ * 4)   # queries^T (f32, as loaded)
          + kib(hpp * 2 * np_ * hh * 2)   # rotated queries (fp16, rewritten per tile)
          + kib(T * 2 * hh * 2) + 1024    # in-tile cos/sin pairs; the exchange slot (1 KiB)
          + kib(stages * T * rk * 2)      # key latent ring
          + kib(stages * 2 * hh * 4)      # tile rotation rows
          + kib(v_stages * T * rv * 2)    # value latent ring
          + kib(hpp * np_ * T * 2)        # probabilities (transposed)
          + kib(hpp * RED_PER_COL * np_ * 4)  # reduction scratch
          + 256)                          # barriers (8 B each)


# Packed latents the kernel reads: bits per code, and fp16 scale/zero (the producer's fp16
# pair arithmetic takes them exactly).
PACKED_BITS = (2, 4)
PACKED_SCALE_DTYPES = ("float16",)


def latent_dtype(bits):
  """The type of the latent tiles the compute warpgroups multiply (and of B_k and p): bf16
  for bf16 latents; fp16 for packed ones, whose codes the converter writes as exact fp16
  (`mosaic_fragments.code_rows`)."""
  return jnp.bfloat16 if bits is None else jnp.float16


def code_order(dim: int, bits: int) -> np.ndarray:
  """Latent channel of each column of a converted tile: a 32-bit code word of 32 / bits
  channels turns into 16 / bits fp16 pairs (channel i, channel i + 16 / bits), laid out pair
  after pair (`mosaic_fragments.code_rows`), i.e. columns (0, 16/b, 1, 16/b + 1, ...)
  of each word."""
  per_word = 32 // bits
  p = np.arange(per_word)
  within = p // 2 + (p % 2) * (per_word // 2)
  return (np.arange(dim) // per_word * per_word + within[np.arange(dim) % per_word]).astype(
      np.int32)


def code_multipliers(dim: int, bits: int) -> np.ndarray:
  """m_j of each column of a key or value tile as `mosaic_fragments.code_rows` writes it
  (m_j * (code - 2^(bits - 1))): fp16 pair k of a code word's byte half holds its codes
  shifted left by bits * (k mod 8 / bits)."""
  per_word = 32 // bits
  pair = (np.arange(dim) % per_word) // 2
  return (2 ** (bits * (pair % (8 // bits)))).astype(np.float32)


def fold_key_operands(b_k, bits):
  """(B_k', 1^T B_k) for key tiles of centred codes. The converted key tile's column j holds
  m_j (c - 2^(bits - 1)) for latent channel code_order[j] (`mosaic_fragments.code_rows`),
  so B_k's rows are permuted to code order and divided by m_j (a power of 2: exact unless an
  entry falls below fp16's normal range), and the kernel forms K = s ⊙ (C' B_k') + z' 1^T
  B_k from the tile's scales s and centred zeros z' = z + 2^(bits - 1) s. b_k [Gr, rk, gh]
  (fp16, its columns already in the kernel's order); 1^T B_k [Gr, gh] float32 of that fp16
  B_k."""
  rk = b_k.shape[1]
  b_k = b_k[:, code_order(rk, bits)]
  b32 = b_k.astype(jnp.float32)
  inv_m = jnp.asarray(1.0 / code_multipliers(rk, bits))[None, :, None]
  return (b32 * inv_m).astype(b_k.dtype), b32.sum(1)


def fold_value_partials(o_t, c2, p):
  """The value product's split partials with the value tile's scale and zero applied: the
  kernel multiplies the tile of centred, scaled codes V'[t, j] = m_j (c_tj - h), h =
  2^(bits - 1), by p^ = fp16(s ⊙ p) and returns c2 = Σ_t (z_t + h s_t) p_t / l per query
  column, so that V^T p / l = Σ_t (s_t c_tj + z_t) p_t / l = o_t[j] / m_j + c2. o_t [...,
  rv, cols], c2 [..., cols]."""
  inv_m = jnp.asarray(1.0 / code_multipliers(p["rv"], p["bits"]))[:, None]
  return o_t * inv_m + c2[..., None, :]


def packed_bits(hk):
  """None for bf16 latents, else the packed latents' code width (`check_inputs` has checked
  that both latents share it)."""
  return hk.bits if isinstance(hk, PackedLatent) else None


def check_inputs(hk, hv, k_bias) -> None:
  """ValueError naming the argument where the kernel cannot take it: a key bias, one
  latent packed and the other not, packed latents of other widths than 2 or 4 bits (or
  of two widths), with row padding, code rows over 256 bytes (one TMA box) or scales
  that are not fp16 (these run on the triton implementation)."""
  if k_bias is not None:
    raise ValueError("mosaic latent attention: k_bias is not supported; use the triton "
                     "implementation")
  packed = [isinstance(x, PackedLatent) for x in (hk, hv)]
  if packed[0] != packed[1]:
    raise ValueError("mosaic latent attention: hk and hv must both be PackedLatent or both "
                     "bf16 arrays (mixed latents run on the triton implementation)")
  if not packed[0]:
    return
  if hk.bits != hv.bits:
    raise ValueError(f"mosaic latent attention: hk.bits ({hk.bits}) != hv.bits ({hv.bits})")
  for name, x in (("hk", hk), ("hv", hv)):
    if x.bits not in PACKED_BITS:
      raise ValueError(f"mosaic latent attention: {name}.bits must be one of {PACKED_BITS}, "
                       f"got {x.bits} (the triton implementation reads 3-bit latents)")
    if x.codes.shape[-1] * 8 != x.dim * x.bits:
      raise ValueError(f"mosaic latent attention: {name} rows hold padding ({x.dim} codes in "
                       f"{x.codes.shape[-1]} bytes)")
    if x.codes.shape[-1] > 256:
      raise ValueError(f"mosaic latent attention: {name} code rows of {x.codes.shape[-1]} "
                       "bytes exceed one 256-element TMA box")
    for part in ("scale", "zero"):
      dt = jnp.dtype(getattr(x, part).dtype).name
      if dt not in PACKED_SCALE_DTYPES:
        raise ValueError(f"mosaic latent attention: {name}.{part} is {dt}, not one of "
                         f"{PACKED_SCALE_DTYPES}")


# Ring depths tried, deepest first, when `stages` / `v_stages` are not given.
AUTO_STAGES = ((2, 2), (1, 2), (2, 1), (1, 1))
# With packed latents, (stages, v_stages, c_stages): a second value slot first (the
# converter then runs a tile ahead of the value products), then the key rings.
AUTO_STAGES_PACKED = ((2, 2, 2), (1, 2, 2), (2, 2, 1), (1, 2, 1), (2, 1, 2), (1, 1, 2),
                      (2, 1, 1), (1, 1, 1))


def shares_values(hpp: int, rv: int) -> bool:
  """Whether the CTA's KV heads share the value product ("shared" values, see `plan`)."""
  return hpp >= 2 and rv % (64 * hpp) == 0


def plan(q_shape, hk_shape, hv_shape, bk_shape, *, heads_per_program=2, stages=None,
         v_stages=None, num_splits=None, target_programs=None, bits=None, c_stages=None):
  """Validates the shapes and knobs; returns the launch geometry (dict).

  The value product is picked here, not a knob: "shared" where `shares_values` holds (the
  heads_per_program KV heads of a CTA share the value latent: warpgroup w multiplies all
  their probabilities [T, hpp * NP] by its rv / hpp rows of the tile, the softmax rescales
  exchanged through shared memory; hpp times fewer narrow wgmmas per warpgroup), else
  "per-head" (each compute warpgroup multiplies its KV head's probabilities [T, NP] by the
  whole value-latent tile).
  stages / v_stages: key / value ring depths; None: the deepest that fit (AUTO_STAGES).
  bits: None for bf16 latents, else the packed latents' code width (`packed_bits`);
  c_stages: then the key code ring's depth (None: with stages and v_stages, the first of
  AUTO_STAGES_PACKED that fits).
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
  if c_stages is not None and c_stages < 1:
    raise ValueError(f"mosaic latent attention: c_stages must be >= 1, got {c_stages}")
  if bits is not None and T * gr // 8 > 256:
    raise ValueError(f"mosaic latent attention: {gr} head groups: a tile's scale rows exceed "
                     "one 256-row TMA box (at most 32 groups with packed latents)")
  if bits is None:
    if c_stages is not None:
      raise ValueError("mosaic latent attention: c_stages is the packed latents' code ring; "
                       "these latents are not packed")
    c_stages = 0
  smem = lambda k, v, c: _smem_bytes(hpp, rk, rv, hh, np_, k, v, bits, gr, c)
  if None in (stages, v_stages, c_stages):  # the deepest rings that fit (given ones kept)
    order = (AUTO_STAGES_PACKED if bits is not None
             else tuple((k, v, 0) for k, v in AUTO_STAGES))
    fitting = [(k, v, c) for k, v, c in order
               if (stages in (None, k) and v_stages in (None, v) and c_stages in (None, c)
                   and smem(k, v, c) <= SMEM_LIMIT)]
    stages, v_stages, c_stages = fitting[0] if fitting else (
        stages or 1, v_stages or 1, 1 if c_stages is None else c_stages)
  need = smem(stages, v_stages, c_stages)
  if need > SMEM_LIMIT:
    packed = f", c_stages={c_stages} ({bits}-bit latents)" if bits is not None else ""
    raise ValueError(f"mosaic latent attention: heads_per_program={hpp}, stages={stages}, "
                     f"v_stages={v_stages}{packed} need "
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
              bits=bits, c_stages=c_stages, grid=(parallel, ns))


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
