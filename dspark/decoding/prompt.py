"""Reading a prompt into a model's cache (the target's, or a draft model's)."""
from __future__ import annotations

from typing import Optional

import numpy as np

PREFILL_CHUNK = 64  # rows a pass: long prompts in pieces, so concurrent rounds are not held long


def read_prompt(lm, cache, prompt: list[int], want_taps: bool = False,
                start: int = 0) -> Optional[np.ndarray]:
    """Everything but the prompt's last token (each round feeds it as the root) into ``cache``
    from row ``start`` (the rows before it are there already: a prefix cache's); the rows' taps
    when asked. Nothing reads these rows' logits, so a runtime that can skip the
    head's product (``skips_logits``) does: for SmolLM2 a sixth of a 64-row chunk's work."""
    skip = {"logit_rows": ()} if lm.skips_logits else {}
    taps = []
    for begin in range(start, len(prompt) - 1, PREFILL_CHUNK):
        chunk = prompt[begin:min(begin + PREFILL_CHUNK, len(prompt) - 1)]
        positions = np.arange(begin, begin + len(chunk))
        if want_taps:
            taps.append(lm.forward(cache, chunk, positions, want_taps=True, **skip)[1])
        else:
            lm.forward(cache, chunk, positions, **skip)
    return np.concatenate(taps) if taps else None
