"""What one generation did: tokens, target passes, guesses proposed and accepted, time spent."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    generated_tokens: int = 0
    rounds: int = 0  # target passes after the prefill
    proposed: int = 0  # guesses on the deepest path of each pass (a chain: its length)
    accepted: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0  # the target reading the prompt (the same for every method)
    cached_prompt_tokens: int = 0  # prompt rows copied from the prefix cache, not computed
    draft_s: float = 0.0
    target_s: float = 0.0
    finish_reason: str = ""  # length, stop, eos, cancelled
    reported: int = 0  # generated tokens a server has already counted in its metrics
    # per depth d (index d - 1): passes whose tree reached depth d, and that accepted a token there
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (accepted guesses + the target's own token)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    def record_pass(self, depth: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += depth
        self.accepted += accepted
        while len(self.proposed_at) < depth:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for d in range(depth):
            self.proposed_at[d] += 1
            self.accepted_at[d] += d < accepted
