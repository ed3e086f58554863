"""Pure functional Llama-family decoder: forward(params, tokens, positions, caches, spec)."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from kvlowrank.cache import base as cache_base
from kvlowrank.cache.base import AttnInputs
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.model.projection import project
from kvlowrank.model import row_slices
from kvlowrank.model.rope import apply_rope
from kvlowrank.spec import ModelSpec


def rms_norm(x, w, eps):
  """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w * y.astype(x.dtype)


def qkv_projections(lp, h, positions, spec: ModelSpec):
  """h [B,T,D] → q [B,T,N,H] (RoPE), AttnInputs for the cache."""
  b, t, _ = h.shape
  q = project(h, lp["wq"])
  k = project(h, lp["wk"])
  v = project(h, lp["wv"])
  if spec.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  q = q.reshape(b, t, spec.n_heads, spec.head_dim)
  k = k.reshape(b, t, spec.n_kv_heads, spec.head_dim)
  v = v.reshape(b, t, spec.n_kv_heads, spec.head_dim)
  q = apply_rope(q, positions, spec)
  k_rot = apply_rope(k, positions, spec)
  return q, AttnInputs(x=h, k=k_rot, k_pre=k, v=v, positions=positions)


def _reduce(y, axis_name: Optional[str]):
  """Sums the partial products of a row-split matmul over the tensor-parallel mesh axis."""
  return y if axis_name is None else jax.lax.psum(y, axis_name)


def mlp(lp, h, axis_name: Optional[str] = None):
  """SwiGLU MLP; under tensor parallelism gate/up hold a column block and w_down the
  matching row block (Megatron), so only the output is summed over `axis_name`."""
  gated = jax.nn.silu(project(h, lp["w_gate"])) * project(h, lp["w_up"])
  return _reduce(project(gated, lp["w_down"]), axis_name)


def cache_step(cache, inputs: AttnInputs, q, lp, carry, spec: ModelSpec):
  """The default cache call of one forward: `cache.step` over all T tokens at once.

  Returns:
    (out [B,T,N,Hv], cache, carry).
  """
  out, _, cache, carry = cache.step(inputs, q, lp, carry, spec=spec)
  return out, cache, carry


def attention_block(lp, x, positions, cache, carry, spec: ModelSpec, *, step=cache_step,
                    axis_name: Optional[str] = None):
  """One layer's attention sublayer. cache None → uncached causal attention over x.

  `step(cache, inputs, q, lp, carry, spec) -> (out, cache, carry)` runs the cache call;
  kvlowrank.model.segments replaces it to feed the tokens segment by segment.
  axis_name: tensor parallelism (`kvlowrank.parallel`): this device holds a block of whole
  KV heads (spec is the local one) and a row block of W_o; the partial outputs are summed
  over the axis before the (replicated) output bias.
  """
  h = rms_norm(x, lp["attn_norm"], spec.norm_eps)
  q, inputs = qkv_projections(lp, h, positions, spec)
  if cache is None:
    valid = positions >= 0
    out, _ = dot_product_attention(q, inputs.k, inputs.v, positions, positions, valid,
                                   sliding_window=spec.sliding_window, out_dtype=q.dtype)
  else:
    out, cache, carry = step(cache, inputs, q, lp, carry, spec)
  b, t = x.shape[:2]
  o = _reduce(project(out.reshape(b, t, -1).astype(x.dtype), lp["wo"]), axis_name)
  if "bo" in lp:
    o = o + lp["bo"]
  return o, h, cache, carry


def decoder_layer(lp, x, positions, cache, carry, spec: ModelSpec, *, step=cache_step,
                  axis_name: Optional[str] = None):
  """Attention and MLP sublayers with their residuals → (x, h, cache, carry); h is the
  normed attention input (calibration statistics)."""
  o, h, cache, carry = attention_block(lp, x, positions, cache, carry, spec, step=step,
                                       axis_name=axis_name)
  x = x + o
  x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], spec.norm_eps), axis_name)
  return x, h, cache, carry


def embed(params, tokens, axis_name: Optional[str] = None):
  """Token embeddings [B, T, D]. Under tensor parallelism the table is split over the
  vocabulary: each device looks up the ids in its block (zeros elsewhere) and the one
  non-zero row per token is summed over `axis_name` (exact)."""
  table = params["embed"]
  if axis_name is None:
    return table[tokens]
  v_local = table.shape[0]
  local = tokens - jax.lax.axis_index(axis_name) * v_local
  inside = (local >= 0) & (local < v_local)
  rows = jnp.where(inside[..., None], table[jnp.clip(local, 0, v_local - 1)], 0)
  return jax.lax.psum(rows.astype(table.dtype), axis_name)


def lm_head(params, x, spec: ModelSpec):
  """Final norm and output projection: x [B,T,D] → fp32 logits [B,T,V] (under tensor
  parallelism: this device's vocabulary block of the logits)."""
  x = rms_norm(x, params["final_norm"], spec.norm_eps)
  head = params["embed"].T if spec.tie_embeddings else params["lm_head"]
  return project(x, head).astype(jnp.float32)


def check_context(positions, caches: Optional[tuple], spec: ModelSpec, *,
                  allow_beyond_max_seq_len: bool = False) -> Optional[int]:
  """Refuses tokens that cannot be right: beyond the caches' capacity, or beyond the
  model's trained context `spec.max_seq_len` unless `allow_beyond_max_seq_len`.

  Raises what is known while tracing (the token axis T, positions when concrete; see
  kvlowrank.cache.base `check_capacity`) and returns the position limit the traced
  positions must stay under (None: nothing left to check), for `poison_rows`.

  Raises:
    ValueError naming the limit.
  """
  limit = None
  if caches is not None:
    cap = min(int(c.capacity) for c in caches)
    cache_base.check_capacity(cap, positions)
    limit = cap
  if not allow_beyond_max_seq_len:
    cache_base.check_capacity(
        spec.max_seq_len, positions, what="model's max_seq_len",
        hint="the model was trained on shorter contexts (allow_beyond_max_seq_len=True "
        "runs past them anyway)")
    limit = spec.max_seq_len if limit is None else min(limit, spec.max_seq_len)
  return limit


def forward(params, tokens, positions, caches: Optional[tuple], spec: ModelSpec, *,
            capture_inputs: bool = False, last_only: bool = False,
            logits_at: Optional[jax.Array] = None,
            allow_beyond_max_seq_len: bool = False, axis_name: Optional[str] = None,
            rows_per_pass: Optional[int] = None):
  """Runs the decoder on T new tokens.

  Args:
    params: parameter pytree (see kvlowrank.model.params).
    tokens: [B, T] int32 token ids.
    positions: [B, T] int32 absolute positions; < 0 marks padding.
    caches: tuple of per-layer caches (see kvlowrank.cache.base) or None for an
      uncached causal forward over these T tokens only.
    spec: static ModelSpec.
    capture_inputs: also return the per-layer normed attention inputs x [L,B,T,D]
      (calibration statistics for Palu / XQuant).
    last_only: return logits for the last position of each row only ([B, 1, V]).
    logits_at: optional [B] int index into T; return logits for that one position of
      each row only ([B, 1, V]): the last real token of right-padded ragged prompts,
      without materialising [B, T, V] logits.
    allow_beyond_max_seq_len: let positions reach past spec.max_seq_len (the model's
      trained context); by default that is an error, like tokens beyond the caches'
      capacity (`check_context`).
    axis_name: set by `kvlowrank.parallel.forward`, which runs this function on every
      device of a mesh (shard_map) with the local spec and parameter shards: whole KV heads
      (q/k/v column blocks, W_o row block), MLP column/row blocks, vocabulary blocks of the
      embedding and LM head; the row-split products are summed over this mesh axis.
    rows_per_pass: run the batch this many rows at a time (`kvlowrank.model.row_slices`:
      one pass per slice, the weights read once per pass); None: the bound the caches set
      (`KVCache.rows_per_pass`, e.g. XQuant-CL's carry), else the whole batch; 0: the whole
      batch.
  Returns:
    (logits [B, T, V] fp32, caches) or (logits, caches, captured) when capture_inputs.
    Under `jit` positions are traced and only T is checked: a row with a position
    beyond the caches' capacity (or max_seq_len) gets NaN logits instead of an error.
  Raises:
    ValueError: more tokens than the caches' capacity (T, or concrete positions), or
      beyond max_seq_len unless allowed.
  """
  limit = check_context(positions, caches, spec,
                        allow_beyond_max_seq_len=allow_beyond_max_seq_len)
  rows = row_slices.rows_per_pass(caches) if rows_per_pass is None else rows_per_pass
  if caches is not None and rows and rows < tokens.shape[0]:
    def one_pass(tok, pos, at, c):
      out = forward(params, tok, pos, c, spec, capture_inputs=capture_inputs,
                    last_only=last_only, logits_at=at,
                    allow_beyond_max_seq_len=allow_beyond_max_seq_len,
                    axis_name=axis_name, rows_per_pass=0)
      return (out[0], out[2], out[1]) if capture_inputs else out
    *outs, caches = row_slices.run(one_pass, rows, (tokens, positions, logits_at), caches,
                                   (0, 1) if capture_inputs else (0,))
    return (outs[0], caches, outs[1]) if capture_inputs else (outs[0], caches)
  x = embed(params, tokens, axis_name)
  # A decode step defers the caches' periodic work (GEAR's chunk compression) to one
  # conditional before all layers (`cache_base.begin_decode_step`): the work the previous step
  # left, done before this step's attention reads the caches.
  decode = caches is not None and tokens.shape[1] == 1
  if decode:
    caches = cache_base.begin_decode_step(caches)
  new_caches = []
  captured = []
  carry: Any = None
  for i, lp in enumerate(params["layers"]):
    cache = None if caches is None else caches[i]
    x, h, cache, carry = decoder_layer(lp, x, positions, cache, carry, spec,
                                       axis_name=axis_name)
    if capture_inputs:
      captured.append(h)
    new_caches.append(cache)
  if logits_at is not None:
    x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)
  elif last_only:
    x = x[:, -1:]
  logits = lm_head(params, x, spec)
  if limit is not None and cache_base.concrete(positions) is None:
    logits = cache_base.poison_rows(logits, positions, limit)
  out_caches = None if caches is None else tuple(new_caches)
  if decode:
    out_caches = cache_base.end_decode_step(out_caches)
  if capture_inputs:
    return logits, out_caches, jnp.stack(captured)
  return logits, out_caches
