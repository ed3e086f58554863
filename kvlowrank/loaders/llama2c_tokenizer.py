"""llama2.c's tokenizer (tokenizer.bin / tok<V>.bin): sentencepiece-style BPE by scores.

File format (llama2.c `build_tokenizer`): int32 max_token_length, then for each
token: float32 score, int32 byte length, the piece's bytes. Pieces spell spaces as
" " (sentencepiece's U+2581 replaced at export) and bytes as "<0xXX>".

Encoding follows llama2.c `encode`: optional BOS (id 1), a dummy-prefix " " token,
one token per UTF-8 codepoint (or its "<0xXX>" byte tokens when the codepoint is not
a piece), then repeatedly merge the adjacent pair whose concatenation is a piece
with the highest score (leftmost on ties) until no pair merges. llama2.c rescans
every pair after each merge (quadratic in the text length); `_merge` finds the same
merge sequence with a heap over a linked list of symbols (O(n log n)).
"""

from __future__ import annotations

import heapq
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from kvlowrank.loaders.chat_template import render_chat_template

BOS_ID, EOS_ID = 1, 2


class Llama2cTokenizer:
  """The llama2.c tokenizer behind the kvlowrank Tokenizer interface."""

  def __init__(self, pieces: Sequence[bytes], scores: Sequence[float], source: str):
    self.pieces = list(pieces)
    self.scores = np.asarray(scores, np.float32)
    self.source = source
    self.vocab_size = len(self.pieces)
    self.bos_id, self.eos_ids, self.adds_bos = BOS_ID, (EOS_ID,), True
    self._lookup: dict[bytes, int] = {}
    for i, p in enumerate(self.pieces):
      self._lookup.setdefault(p, i)
    self._byte_ids = [self._lookup.get(b"<0x%02X>" % b) for b in range(256)]
    # llama2.c's fixed ids: 0 <unk>, 1 BOS ("\n<s>\n" in the file), 2 EOS ("\n</s>\n").
    self._special = {i for i in (0, BOS_ID, EOS_ID) if i < self.vocab_size}

  @classmethod
  def from_file(cls, path: Path) -> "Llama2cTokenizer":
    """Parses a llama2.c tokenizer file; ValueError naming the file when malformed."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 4:
      raise ValueError(f"{path}: truncated llama2.c tokenizer (no max_token_length header)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    pieces, scores, off = [], [], 4
    while off < len(data):
      if off + 8 > len(data):
        raise ValueError(f"{path}: truncated llama2.c tokenizer at token {len(pieces)}")
      score, n = struct.unpack_from("<fi", data, off)
      off += 8
      if n < 0 or n > max_len or off + n > len(data):
        raise ValueError(f"{path}: corrupt llama2.c tokenizer: token {len(pieces)} has length "
                         f"{n} (max_token_length {max_len}, {len(data) - off} bytes left)")
      pieces.append(data[off:off + n])
      scores.append(score)
      off += n
    return cls(pieces, scores, str(path))

  def _byte_tokens(self, bs: bytes) -> list[int]:
    out = []
    for b in bs:
      if self._byte_ids[b] is None:
        raise ValueError(f"{self.source}: byte 0x{b:02X} has no <0x{b:02X}> token")
      out.append(self._byte_ids[b])
    return out

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text` (llama2.c `encode`); BOS (1) first when `add_bos`."""
    raw = text.encode("utf-8")
    ids: list[int] = []
    if raw:  # llama2.c's dummy prefix: a leading space token, merged like any other
      ids += [self._lookup[b" "]] if b" " in self._lookup else self._byte_tokens(b" ")
    i = 0
    while i < len(raw):  # one codepoint (at most 4 bytes, as llama2.c) at a time
      j = i + 1
      while j < len(raw) and (raw[j] & 0xC0) == 0x80 and j - i < 4:
        j += 1
      cp = raw[i:j]
      ids += [self._lookup[cp]] if cp in self._lookup else self._byte_tokens(cp)
      i = j
    ids = self._merge(ids)
    return ([self.bos_id] + ids) if add_bos else ids

  def _merge(self, ids: list[int]) -> list[int]:
    """llama2.c's merge loop with a heap: same merges, in the same order.

    llama2.c repeatedly merges the adjacent pair whose concatenation is a piece of
    highest score (strict `>` from -1e10: the leftmost such pair on ties; scores <= -1e10
    never merge). Heap entries are (-score, left symbol index, left id, right id); a
    merged symbol keeps its left index, so index order is list order and the heap order
    is exactly that rule. An entry is stale (skipped) when either side has changed.
    """
    n = len(ids)
    if n < 2:
      return ids
    ids = list(ids)
    nxt = list(range(1, n + 1))    # n marks the end of the list
    prv = list(range(-1, n - 1))
    alive = [True] * n

    def entry(i, j):
      cand = self._lookup.get(self.pieces[ids[i]] + self.pieces[ids[j]])
      if cand is None or not float(self.scores[cand]) > -1e10:
        return None
      return (-float(self.scores[cand]), i, ids[i], ids[j], cand)

    heap = [e for e in (entry(i, i + 1) for i in range(n - 1)) if e is not None]
    heapq.heapify(heap)
    while heap:
      _, i, left, right, cand = heapq.heappop(heap)
      j = nxt[i] if alive[i] else n
      if j >= n or ids[i] != left or ids[j] != right:
        continue  # stale: a side was merged away or changed since the push
      ids[i] = cand
      alive[j] = False
      nxt[i] = nxt[j]
      if nxt[j] < n:
        prv[nxt[j]] = i
      for a, b in ((prv[i], i), (i, nxt[i])):
        e = entry(a, b) if a >= 0 and b < n else None
        if e is not None:
          heapq.heappush(heap, e)
    return [ids[i] for i in range(n) if alive[i]]

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids`.

    Args:
      ids: token ids.
      skip_special: drop <unk>/BOS/EOS (otherwise their pieces are written as stored).
    Returns:
      The text. As sentencepiece / llama2.c, the leading space of the first piece (at
      the start, or right after BOS) is the dummy prefix and is dropped.
    """
    out = bytearray()
    at_start = True
    for t in ids:
      t = int(t)
      if not 0 <= t < self.vocab_size:
        raise ValueError(f"token id {t} outside the vocabulary of {self.vocab_size}")
      if t in self._special:
        if not skip_special:
          out += self.pieces[t]
        at_start = t == self.bos_id
        continue
      piece = self.pieces[t]
      if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
        piece = bytes([int(piece[3:5], 16)])
      elif at_start and piece.startswith(b" "):
        piece = piece[1:]
      out += piece
      at_start = False
    return out.decode("utf-8", errors="replace")

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
    """llama2.c models have no chat template: always a ValueError."""
    return render_chat_template(None, messages, add_generation_prompt=add_generation_prompt,
                                bos_token=None, eos_token=None, source=self.source)
