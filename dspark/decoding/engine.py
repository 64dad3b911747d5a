"""Speculative decoding over ORT sessions: plain, draft (adaptive k), prompt lookup, hybrid
(the draft chain plus the lookup chain where a match of at least ``HYBRID_MIN_NGRAM`` tokens
exists; sampled: the lookup where it matches, the draft otherwise) and tree.

Every method proposes a tree of tokens (a chain is a tree of width 1) hanging off the last
committed token, the target scores the whole tree in one pass with a tree attention mask, the
longest accepted path is kept in the cache (rows compacted in place) and one more token comes
from the target at the end of that path. Greedy acceptance follows the target's argmax, so the
output equals plain decoding token for token: the graph's rows are bit-identical however they
are batched (see ``onnx_lm``). Sampled acceptance uses the rejection rule in ``sampling``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dspark.decoding.lm import KVCache, OnnxLM
from dspark.decoding.sampling import (SamplingParams, SpeculativeParams, accept_among,
                                      distribution, sample)
from dspark.errors import RequestError

PREFILL_CHUNK = 64
# Prompt lookup costs nothing to propose; each guess adds a row to the target's pass, about
# this fraction of a pass on this CPU (17 rows ~ 1.6-2.4x one row).
NGRAM_ROW_COST = 0.05
# Greedy trees add a side branch only where the draft gives its path at least this probability.
LOG_MIN_PATH_PROB = float(np.log(0.05))
# A draft chain stops early after a token the draft itself gives less than this probability:
# the next token would likely be rejected, and a draft call costs ~0.1 of a target pass while
# one more verified row costs ~0.02.
DRAFT_MIN_CONFIDENCE = 0.15
# Hybrid: a lookup match this long is trusted over the draft (a 1-token match is mostly noise).
HYBRID_MIN_NGRAM = 2


class PromptTooLong(RequestError):
    """The prompt is empty or does not fit the context."""

    def __init__(self, reason: str):
        super().__init__("text_input", reason)


@dataclass
class DecodeStats:
    generated_tokens: int = 0
    rounds: int = 0  # target passes after the prefill
    proposed: int = 0
    accepted: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0  # the target reading the prompt (the same for every method)
    draft_s: float = 0.0
    target_s: float = 0.0
    finish_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (accepted drafts + the target's own token)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0


@dataclass
class _Tree:
    """Draft tokens below the root (the last committed token, row 0 of the verify pass)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = root
    depths: list[int] = field(default_factory=list)  # 1 = child of root
    candidates: dict[int, list[int]] = field(default_factory=dict)  # node (-1=root) -> draws
    q: dict[int, np.ndarray] = field(default_factory=dict)  # node -> draft dist of its children
    draft_rows: dict[int, int] = field(default_factory=dict)  # node -> row in the draft cache

    def add(self, token: int, parent: int) -> int:
        for child in self.candidates.get(parent, []):
            if self.tokens[child] == token:
                self.candidates[parent].append(child)  # repeated draw of the same token
                return child
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.candidates.setdefault(parent, []).append(node)
        return node

    def children(self, node: int) -> list[int]:
        return list(dict.fromkeys(self.candidates.get(node, [])))

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def mask(self) -> np.ndarray:
        """(1 + n) x (1 + n) visibility of the verify pass: row 0 is the root."""
        m = np.eye(len(self.tokens) + 1, dtype=bool)
        for i, parent in enumerate(self.parents):  # a parent's row is always filled first
            m[i + 1] |= m[parent + 1]
        return m


class SpeculativeEngine:
    """Token-level decoding; ``dspark.decoding.text`` adds the tokenizer, stop strings, streams."""

    def __init__(self, target: OnnxLM, draft: OnnxLM | None = None, max_ngram: int = 3,
                 draft_min_confidence: float = DRAFT_MIN_CONFIDENCE):
        self.target = target
        self.draft = draft
        self.max_ngram = max_ngram
        self.draft_min_confidence = draft_min_confidence
        if draft is not None and draft.config.vocab != target.config.vocab:
            raise ValueError("draft and target must share the tokenizer (vocab sizes differ)")

    @property
    def context(self) -> int:
        return self.target.config.ctx

    def generate(self, prompt: list[int], sampling: SamplingParams, spec: SpeculativeParams,
                 stats: DecodeStats | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[list[int]]:
        """Yield the newly committed tokens after each target pass."""
        stats = stats if stats is not None else DecodeStats()
        spec.validate()
        sampling.validate()
        uses_draft = spec.method in ("draft", "tree", "hybrid")
        if uses_draft and self.draft is None:
            raise ValueError(f"method {spec.method!r} needs a draft model")
        if not prompt:
            raise PromptTooLong("the prompt is empty; give at least one token")
        if len(prompt) >= self.context:
            raise PromptTooLong(f"prompt is {len(prompt)} tokens but the context is "
                                f"{self.context}; shorten it to at most {self.context - 1}")
        rng = np.random.default_rng(sampling.seed)
        history = list(prompt)
        target_cache = self.target.new_cache(self.context)
        draft_cache = self.draft.new_cache(self.context) if uses_draft else None
        # The draft reads the prompt on its own thread while the target does (ORT and the C
        # kernel release the GIL), so its prefill hides behind the target's.
        draft_prefill = (_Background(_prefill, self.draft, draft_cache, prompt)
                         if draft_cache is not None else None)
        t = time.perf_counter()
        _prefill(self.target, target_cache, prompt)
        stats.prefill_s = time.perf_counter() - t
        if draft_prefill is not None:
            t = time.perf_counter()
            draft_prefill.wait()
            stats.draft_s += time.perf_counter() - t
        # adaptive k per proposer: running acceptance rate per proposed token (an optimistic
        # start) and proposal cost per token relative to a target pass
        ks = {"draft": spec.num_speculative_tokens, "ngram": spec.num_speculative_tokens}
        rates = {"draft": 0.7, "ngram": 0.7}
        costs = {"draft": 0.25, "ngram": NGRAM_ROW_COST}
        # Greedy hybrid verifies the draft chain and the lookup chain together as two branches
        # (a draft step costs ~0.02 of a target pass, a row ~0.03); sampled hybrid takes one of
        # them, since the rejection rule needs one proposer per node.
        merge = spec.method == "hybrid" and sampling.greedy
        width = spec.tree_width if spec.method == "tree" else 2 if merge else 1
        generated = 0
        while generated < sampling.max_tokens:
            if cancelled is not None and cancelled():
                stats.finish_reason = "cancelled"
                break
            room = self.context - len(history)  # cache rows left after the root's
            budget = min(sampling.max_tokens - generated, room + 1)
            if budget <= 0:
                stats.finish_reason = "length"
                break
            limit = min(budget - 1, room // width)
            t = time.perf_counter()
            tree, lookup, drafted = _Tree(), [], []
            if spec.method in ("ngram", "hybrid") and limit > 0:
                tree = self._ngram_tree(history, min(ks["ngram"], limit),
                                        HYBRID_MIN_NGRAM if spec.method == "hybrid" else 1)
                lookup = list(tree.tokens)
            if uses_draft and (merge or not lookup) and limit > 0:
                depth = min(spec.num_speculative_tokens if spec.method == "tree" else ks["draft"], limit)
                tree = self._draft_tree(draft_cache, history, depth, 1 if merge else width,
                                        sampling, rng, stats)
                drafted = list(tree.tokens)
                parent = -1
                for tok in lookup:  # merged where the two agree
                    parent = tree.add(tok, parent)
            t_draft = time.perf_counter() - t
            stats.draft_s += t_draft
            t = time.perf_counter()
            new, path = self._verify(target_cache, history, tree, sampling, rng)
            t_target = time.perf_counter() - t
            stats.target_s += t_target
            stats.rounds += 1
            stats.proposed += len(tree.tokens) and max(tree.depths)
            stats.accepted += len(new) - 1
            if drafted:
                self._commit_draft(draft_cache, tree, path, len(history))
            history.extend(new)  # the tree's depth kept it within max_tokens
            generated += len(new)
            stats.generated_tokens = generated
            if spec.method != "tree" and spec.adaptive:
                for who, chain in (("draft", drafted), ("ngram", lookup)):
                    if not chain:
                        continue
                    rates[who] = 0.8 * rates[who] + 0.2 * _agreed(chain, new) / len(chain)
                    if who == "draft" and t_target > 0:
                        costs[who] = 0.8 * costs[who] + 0.2 * (t_draft / len(chain)) / t_target
                    ks[who] = best_k(rates[who], costs[who], spec.num_speculative_tokens)
            yield new
        else:
            stats.finish_reason = "length"

    # -- proposals ---------------------------------------------------------------------------
    def _ngram_tree(self, history: list[int], depth: int, min_n: int = 1) -> _Tree:
        """Prompt lookup: the tokens that followed the latest earlier match of the last n
        (n from ``max_ngram`` down to ``min_n``)."""
        tree = _Tree()
        h = np.asarray(history)
        for n in range(min(self.max_ngram, len(h) - 1), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                parent = -1
                for tok in h[start:start + depth]:
                    parent = tree.add(int(tok), parent)
                return tree
        return tree

    def _draft_tree(self, cache: KVCache, history: list[int], depth: int, width: int,
                    sampling: SamplingParams, rng: np.random.Generator,
                    stats: DecodeStats) -> _Tree:
        """Greedy: a beam of ``width`` best paths by draft log-probability, level by level.
        Sampled: ``width`` chains drawn i.i.d. from the draft (merged where they agree), so
        every node's candidates are i.i.d. draws, as lossless tree verification needs."""
        tree = _Tree()
        catch_up = history[cache.length:]  # the root and anything committed since last round
        logits = self.draft.forward(cache, catch_up, np.arange(cache.length, len(history)))[-1:]
        stats.draft_calls += 1
        committed = cache.length
        root_pos = len(history) - 1
        frontier = [-1]
        chain_node = -1
        confidence = 1.0
        scores = {-1: 0.0}
        for level in range(1, depth + 1):
            if level > 1:
                nodes = frontier
                past = None  # rows fed so far form one chain: all are ancestors of every node
                if len(tree.draft_rows) > level - 2:
                    past = np.zeros((len(nodes), cache.length), bool)
                    past[:, :committed] = True
                    for r, node in enumerate(nodes):
                        past[r, [tree.draft_rows[a] for a in tree.ancestors(node)[:-1]]] = True
                base = cache.length
                logits = self.draft.forward(cache, [tree.tokens[n] for n in nodes],
                                            [root_pos + tree.depths[n] for n in nodes],
                                            tree_mask=np.eye(len(nodes), dtype=bool),
                                            past_visible=past)
                stats.draft_calls += 1
                for r, node in enumerate(nodes):
                    tree.draft_rows[node] = base + r
            if sampling.greedy:
                options = []
                for r, node in enumerate(frontier):
                    if width == 1:  # a chain: only the argmax matters
                        tok = int(np.argmax(logits[r]))
                        confidence = 1.0 / float(np.exp(logits[r] - logits[r][tok]).sum())
                        options.append((0.0, node, tok))
                        continue
                    row = logits[r]
                    top = np.argpartition(-row, width - 1)[:width]
                    lse = row.max() + np.log(np.exp(row - row.max()).sum())
                    options += [(scores[node] + float(row[tok] - lse), node, int(tok)) for tok in top]
                options.sort(key=lambda o: -o[0])
                if width > 1:
                    # The draft's own greedy chain always stays (the tree never accepts less
                    # than the chain); other branches only where the draft gives their path
                    # a fair chance, since every node is a row of the target's pass.
                    chain = max((o for o in options if o[1] == chain_node), key=lambda o: o[0])
                    options = [chain] + [o for o in options
                                         if o is not chain and o[0] >= LOG_MIN_PATH_PROB]
                nxt = []
                for score, node, tok in options[:width]:
                    child = tree.add(tok, node)
                    scores[child] = score
                    nxt.append(child)
                chain_node = nxt[0]
                frontier = nxt
            else:
                dists = {node: distribution(logits[r], sampling) for r, node in enumerate(frontier)}
                tree.q.update(dists)
                if level == 1:
                    chains = [tree.add(sample(dists[-1], rng), -1) for _ in range(width)]
                else:
                    chains = [tree.add(sample(dists[c], rng), c) for c in chains]
                frontier = list(dict.fromkeys(chains))
                confidence = max(float(d.max()) for d in dists.values())
            if width == 1 and confidence < self.draft_min_confidence:
                break  # go no deeper than a token the draft itself doubts
        return tree

    # -- verification ------------------------------------------------------------------------
    def _verify(self, cache: KVCache, history: list[int], tree: _Tree,
                sampling: SamplingParams, rng: np.random.Generator) -> tuple[list[int], list[int]]:
        """One target pass over root + tree; keep the accepted path; return the new tokens and
        the accepted nodes."""
        base = cache.length
        root_pos = len(history) - 1
        ids = [history[-1]] + tree.tokens
        positions = [root_pos] + [root_pos + d for d in tree.depths]
        logits = self.target.forward(cache, ids, positions,
                                     tree_mask=tree.mask() if tree.tokens else None)
        node, path, out = -1, [], []
        while True:
            row = logits[node + 1]
            if sampling.greedy:
                tok = int(np.argmax(row))
                match = [c for c in tree.children(node) if tree.tokens[c] == tok]
                if not match:
                    out.append(tok)
                    break
                node = match[0]
            else:
                p = distribution(row, sampling)
                draws = tree.candidates.get(node, [])
                q = tree.q.get(node)  # None for prompt lookup: a deterministic proposal
                chosen, resampled = accept_among(p, q, [tree.tokens[c] for c in draws], rng)
                if chosen < 0:
                    out.append(resampled)
                    break
                node = draws[chosen]
            path.append(node)
            out.append(tree.tokens[node])
        cache.keep_rows(base, np.array([0] + [n + 1 for n in path]))
        return out, path

    def _commit_draft(self, cache: KVCache, tree: _Tree, path: list[int], committed: int) -> None:
        """Keep the draft rows of the accepted path; rows never fed are caught up next round.
        ``committed``: the history (incl. the root), in the draft cache by now."""
        rows = []
        for node in path:
            if node not in tree.draft_rows:
                break
            rows.append(tree.draft_rows[node] - committed)
        cache.keep_rows(committed, np.array(rows, dtype=np.int64))


def _agreed(chain: list[int], new: list[int]) -> int:
    """How many leading tokens of a proposed chain the pass accepted."""
    n = 0
    for proposed, kept in zip(chain, new[:-1]):
        if proposed != kept:
            break
        n += 1
    return n


def _prefill(lm: OnnxLM, cache: KVCache, prompt: list[int]) -> None:
    """Everything but the prompt's last token, which each round feeds as the root."""
    for s in range(0, len(prompt) - 1, PREFILL_CHUNK):
        chunk = prompt[s:min(s + PREFILL_CHUNK, len(prompt) - 1)]
        lm.forward(cache, chunk, np.arange(s, s + len(chunk)))


class _Background:
    """``fn(*args)`` on a thread; ``wait`` joins it and re-raises its error."""

    def __init__(self, fn: Callable[..., None], *args) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # handed to the waiting thread
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def best_k(rate: float, cost_ratio: float, k_max: int) -> int:
    """k maximising expected tokens per unit time: (1 - a^(k+1)) / (1 - a) / (1 + k c)."""
    rate = min(max(rate, 0.01), 0.99)
    ks = np.arange(1, k_max + 1)
    gain = (1 - rate ** (ks + 1)) / (1 - rate) / (1 + ks * cost_ratio)
    return int(ks[np.argmax(gain)])
