"""CompressedModel: a model with a KV-cache method applied (kvlowrank.compress returns it).

It holds the loaded model, the method's validated spec and the parameters the method runs
with (its calibrated ones where it calibrates), and offers generation, evaluation
(perplexity in prefill/decode mode, optionally generation drift) and byte counts, each
through the same library functions the harness uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank import config_lib
from kvlowrank.cache.base import caches_nbytes, init_caches
from kvlowrank.data import text as text_lib
from kvlowrank.eval import drift as drift_lib
from kvlowrank.eval.perplexity import perplexity
from kvlowrank.experiment.spec import DataSpec, EvalSpec
from kvlowrank.generate import GenerationResult, generate, make_sampler
from kvlowrank.generate.runner import encode_prompt
from kvlowrank.loaders import LoadedModel
from kvlowrank.methods import dense_kv_bytes_per_token, get_method


def exact_window_note(method: str, spec, prompt_len: int, max_new_tokens: int
                      ) -> Optional[str]:
  """The warning for a generation that an exact recent window hides (KIVI's residual R:
  the last R tokens stay unquantized), or None."""
  r = getattr(spec, "residual", 0) or 0
  if not r or max_new_tokens > r:
    return None
  total = prompt_len + max_new_tokens
  head = (f"note: {method} keeps up to the last {r} tokens exact "
          f"({type(spec).__name__}.residual={r})")
  if total <= r:
    return (f"{head}, and this generation ({prompt_len} prompt + {max_new_tokens} new "
            f"tokens) fits in that window: nothing is quantized, so it equals the dense "
            f"cache's. Generate more than {r} tokens in all, or pass residual=0, to see "
            "the quantization.")
  return (f"{head}: the {max_new_tokens} generated tokens are shorter than that window, so "
          f"recent context is mostly attended exactly and this generation understates the "
          f"quantization error (residual=0 quantizes everything).")


@dataclasses.dataclass(frozen=True)
class CompressedModel:
  """A model with a KV-cache method applied.

  Attributes:
    model: the LoadedModel (spec, original params, tokenizer, source).
    method: registered method name (kvlowrank.methods.methods()).
    spec: the method's validated spec dataclass.
    params: the parameters the method runs with (calibrated where it calibrates).
    cache_dtype: storage dtype of exact K/V and residual windows.
    calibration: the calibration's hash / path / restored flag, None if not calibrated.
  """

  model: LoadedModel
  method: str
  spec: Any
  params: Any
  cache_dtype: str = "bfloat16"
  calibration: Optional[dict] = None

  @property
  def cache(self) -> str:
    """The registered cache factory of the method (kvlowrank.cache.init_caches name)."""
    return get_method(self.method).cache

  @property
  def tokenizer(self):
    return self.model.require_tokenizer()

  @property
  def bits(self) -> str:
    return get_method(self.method).bits_label(self.spec, jnp.dtype(self.cache_dtype))

  def kv_bytes_per_token(self) -> float:
    """Analytic KV bytes per token, all layers (codes + amortised scales, no windows)."""
    return get_method(self.method).kv_bytes_per_token(self.model.spec, self.spec, self.params,
                                                      jnp.dtype(self.cache_dtype))

  def nbytes(self, seq_len: int, batch: int = 1) -> int:
    """Bytes a cache of capacity `seq_len` for `batch` rows allocates (all layers; exact
    windows and padding included). Counted on shapes only: nothing is allocated."""
    if seq_len <= 0 or batch <= 0:
      raise ValueError(f"nbytes: seq_len and batch must be positive, got {seq_len}, {batch}")
    shapes = jax.eval_shape(
        lambda p: init_caches(self.cache, self.spec, self.model.spec, p, batch=batch,
                              capacity=seq_len, dtype=jnp.dtype(self.cache_dtype)),
        self.params)
    return caches_nbytes(shapes)

  def init_caches(self, batch: int, capacity: int) -> tuple:
    """Fresh caches for kvlowrank.model.forward with this method."""
    return init_caches(self.cache, self.spec, self.model.spec, self.params, batch=batch,
                       capacity=capacity, dtype=jnp.dtype(self.cache_dtype))

  def generate_tokens(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
                      sampler=None, seed: int = 0, eos_ids: Optional[Sequence[int]] = None,
                      progress: bool = True) -> GenerationResult:
    """kvlowrank.generate with this method's cache, on token-id prompts.

    Args:
      prompts: token-id lists (ragged is fine).
      max_new_tokens: tokens to generate per prompt at most.
      sampler: a kvlowrank.generate sampler (default greedy).
      seed: PRNG seed of stochastic samplers.
      eos_ids: stop ids (default: the tokenizer's, else the model's; () never stops).
      progress: tqdm bar of the generated tokens; prints the exact-window note.
    Returns:
      GenerationResult.
    """
    if eos_ids is None:
      tok = self.model.tokenizer
      eos_ids = (tok.eos_ids if tok is not None else ()) or self.model.spec.eos_ids
    if progress:
      longest = max((len(p) for p in prompts), default=0)
      note = exact_window_note(self.method, self.spec, longest, int(max_new_tokens))
      if note:
        print(note)
    return generate(self.params, self.model.spec, prompts, max_new_tokens=max_new_tokens,
                    sampler=sampler or make_sampler("greedy"), rng=jax.random.key(seed),
                    cache_method=self.cache, cache_spec=self.spec,
                    cache_dtype=jnp.dtype(self.cache_dtype), eos_ids=eos_ids,
                    progress=progress)

  def generate(self, prompts: Union[str, Sequence[str]], max_new_tokens: int = 32, *,
               chat: bool = False, sampler: str = "greedy", temperature: float = 1.0,
               top_k: int = 50, top_p: float = 0.9, seed: int = 0,
               progress: bool = True) -> Union[str, list[str]]:
    """Continues text prompts with this method's cache.

    Args:
      prompts: one prompt or a list of prompts.
      max_new_tokens: tokens to generate per prompt at most (stops at EOS).
      chat: wrap each prompt as one user turn of the model's chat template.
      sampler, temperature, top_k, top_p: greedy | temperature | top_k | top_p and knobs.
      seed: PRNG seed of stochastic samplers.
      progress: tqdm bar of the generated tokens.
    Returns:
      the completion (a str for a str prompt, else a list of str).
    """
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    tok = self.tokenizer
    ids = [encode_prompt(tok, t, chat) for t in texts]
    res = self.generate_tokens(ids, max_new_tokens, seed=seed, progress=progress,
                               sampler=make_sampler(sampler, temperature=temperature,
                                                    top_k=top_k, top_p=top_p))
    out = [tok.decode(list(t)) for t in res.tokens]
    return out[0] if single else out

  def evaluate(self, *, dataset: str = "wikitext2", split: str = "test", seq_len: int = 512,
               max_windows: int = 4, modes: Sequence[str] = ("prefill", "decode"),
               batch_size: int = 1, prompt_len: Optional[int] = None,
               prefill_chunk: int = 0, drift_tokens: int = 0, drift_prompts: int = 2,
               max_chars: int = 0, path: str = "", progress: bool = True) -> dict:
    """Perplexity (kvlowrank.eval.perplexity) and optionally generation drift
    (kvlowrank.eval.drift) on GPTQ windows of a corpus, as the harness computes them.

    Args:
      dataset, split, path, max_chars: the evaluation text (DataSpec fields).
      seq_len, max_windows, modes, batch_size, prefill_chunk: EvalSpec fields.
      prompt_len: decode mode's prefilled tokens (default seq_len // 2).
      drift_tokens, drift_prompts: > 0 also measures drift against the dense model on
        the first drift_prompts windows' first prompt_len tokens.
      progress: tqdm bars.
    Returns:
      dict: method, bits, kv_bytes_per_token, compression_vs_bf16, ppl_<mode>,
      results (per mode), drift (or None), windows, seq_len.
    """
    data = config_lib.to_dataclass(dict(dataset=dataset, split=split, path=path,
                                        max_chars=max_chars), DataSpec, where="data")
    ev = config_lib.to_dataclass(
        dict(seq_len=seq_len, max_windows=max_windows, modes=tuple(modes),
             batch_size=batch_size, prefill_chunk=prefill_chunk,
             prompt_len=seq_len // 2 if prompt_len is None else prompt_len,
             drift_tokens=drift_tokens, drift_prompts=drift_prompts), EvalSpec, where="eval")
    txt, _ = text_lib.load_text(data.dataset, data.split, source=data.source, path=data.path,
                                path_format=data.path_format, joiner=data.joiner)
    ids = text_lib.tokenize(self.tokenizer, txt, add_bos=data.add_bos,
                            max_chars=data.max_chars)
    windows = text_lib.windows(ids, ev.seq_len, ev.max_windows)
    cache_dtype = jnp.dtype(self.cache_dtype)
    out = {"method": self.method, "bits": self.bits, "seq_len": ev.seq_len,
           "windows": int(windows.shape[0]), "results": {}}
    for mode in ev.modes:
      res = perplexity(self.params, windows, spec=self.model.spec, method=self.cache,
                       method_spec=self.spec, cache_dtype=cache_dtype, mode=mode,
                       batch_size=ev.batch_size, prompt_len=ev.prompt_len,
                       prefill_chunk=ev.prefill_chunk, progress=progress,
                       desc=f"{self.method}-{self.bits} {mode}")
      out["results"][mode] = res.asdict()
      out[f"ppl_{mode}"] = res.ppl
    out["drift"] = None
    if ev.drift_tokens:
      if windows.shape[0] < ev.drift_prompts:
        raise ValueError(f"eval.drift_prompts={ev.drift_prompts} exceeds the "
                         f"{windows.shape[0]} evaluation windows")
      prompts = np.asarray(windows[:ev.drift_prompts, :ev.drift_prompt_length])
      out["drift"] = drift_lib.drift(
          self.model.params, self.params, self.model.spec, prompts, ev.drift_tokens,
          method=self.cache, method_spec=self.spec, cache_dtype=cache_dtype).asdict()
    kv = self.kv_bytes_per_token()
    out["kv_bytes_per_token"] = kv
    out["compression_vs_bf16"] = dense_kv_bytes_per_token(self.model.spec) / kv
    return out
