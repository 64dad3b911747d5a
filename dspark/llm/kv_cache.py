"""What every KV cache here shares: ``length`` rows valid out of ``capacity``, and rollback by
setting a shorter length (rows past it are stale and never attended to). Each runtime keeps its
own storage and its own ``keep_rows`` (moving accepted rows into place)."""
from __future__ import annotations

from dspark.errors import RequestError


class CacheRows:
    length: int
    capacity: int

    def check_room(self, new_rows: int) -> None:
        if self.length + new_rows > self.capacity:
            raise RequestError("tokens", f"context full: {self.length} cached + {new_rows} new > "
                                         f"{self.capacity}")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back cache of length {self.length} to {length}")
        self.length = length
