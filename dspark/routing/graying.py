"""Traffic graying (hash-based version split) and shadow sampling.

The bucket of a key is ``blake2b(salt + key, 8 bytes) mod 10000``: unlike Python's ``hash()``
it is the same in every process, router instance and server, so a user always lands on the
same version while the shares stay unchanged.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Mapping

import numpy as np

BUCKETS = 10_000
_PERSON = b"dspark-graying"


def bucket(key: str, salt: str = "") -> int:
    digest = hashlib.blake2b((salt + "\x00" + key).encode(), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def routing_key(user_id: str | None, request_id: str | None) -> str:
    """User id if given, else request id, else a fresh random id (a random split)."""
    if user_id:
        return "u:" + user_id
    if request_id:
        return "r:" + request_id
    return "x:" + uuid.uuid4().hex


class VersionSplitter:
    """Maps buckets to versions by their percentage shares.

    Ranges are laid out from the top bucket down, newest (highest) version first, so raising a
    canary's share only adds users to it: users already on the canary stay there.
    """

    def __init__(self, shares: Mapping[int, float]):
        self._bounds: list[tuple[int, int]] = []  # (lowest bucket of range, version), top-down
        upper = BUCKETS
        for version in sorted(shares, reverse=True):
            upper -= round(shares[version] * BUCKETS / 100.0)
            self._bounds.append((upper, version))
        # rounding leftovers go to the oldest version
        if self._bounds:
            self._bounds[-1] = (0, self._bounds[-1][1])
        positive = [version for version, share in shares.items() if share > 0]
        self.only = positive[0] if len(positive) == 1 else None  # every key maps to it: no key needed

    def version_for(self, key: str) -> int:
        b = bucket(key, "version")
        for low, version in self._bounds:
            if b >= low:
                return version
        return self._bounds[-1][1]


def shadow_sampled(key: str, percent: float) -> bool:
    """Whether this request is also sent to the shadow version (independent of the version split)."""
    return percent > 0 and bucket(key, "shadow") < percent * BUCKETS / 100.0


def outputs_agree(
    primary: Mapping[str, np.ndarray], shadow: Mapping[str, np.ndarray], atol: float = 0.0, rtol: float = 0.0,
    ignore: tuple[str, ...] = (),
) -> tuple[bool, str]:
    """Compare two sets of output tensors; returns (agree, reason when not)."""
    primary = {k: v for k, v in primary.items() if k not in ignore}
    shadow = {k: v for k, v in shadow.items() if k not in ignore}
    if set(primary) != set(shadow):
        return False, f"output names differ: {sorted(primary)} vs {sorted(shadow)}"
    for name in sorted(primary):
        a, b = np.asarray(primary[name]), np.asarray(shadow[name])
        if a.shape != b.shape:
            return False, f"output '{name}' shape {a.shape} vs {b.shape}"
        if a.dtype.kind in "fc" and b.dtype.kind in "fc":
            if not np.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
                worst = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                return False, f"output '{name}' differs by up to {worst:g} (atol {atol:g}, rtol {rtol:g})"
        elif not np.array_equal(a, b):
            return False, f"output '{name}' values differ"
    return True, ""
