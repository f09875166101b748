"""RACER-style drafts without a draft model (arXiv 2604.14885): plain host-side Python over lists and dicts that grows
one request's draft tree from n-gram retrieval and the target's logit cues, and lays the trees out as a cycle's tensors.
The engine asks for a tree before each racer cycle and tells it the new tokens and cues after."""
import heapq

import torch

LONGEST = 10  # the longest n-gram indexed
CUES = 4  # the target's top next tokens kept per token


class Retrieval:
    """One request's index: every n-gram (n <= LONGEST) of the prompt and the text so far with the tokens that followed
    it, and logit cues (each token's likeliest next tokens under the target, with their probabilities, from the last
    verify row that scored it, rejected rows included). Drafting costs dict lookups, no model."""

    def __init__(self, ids, chain=True):
        self.chain = chain  # one child per node: a chain of the likeliest tokens
        self.ctx = []  # the text so far
        self.follow = {}  # n-gram -> {next token: count}
        self.cue = {}  # token -> [(next token, probability)]
        self.last = []  # the last draft's nodes, the root first
        self.seen = 0
        self.observe(ids)
        self.seen = 0  # generated tokens observed
        self.cycles = 0  # cycles whose cues were taken

    def observe(self, tokens, cues=None):
        """New tokens of the text; cues: [(tokens [CUES], probabilities [CUES])] for each node of the last tree,
        the root (the token before the draft) first."""
        for token, cue in zip(self.last, cues or []):
            self.cue[token] = list(zip(*cue))
        for t in tokens:
            for n in range(1, min(LONGEST, len(self.ctx)) + 1):
                counts = self.follow.setdefault(tuple(self.ctx[-n:]), {})
                counts[t] = counts.get(t, 0) + 1
            self.ctx.append(t)
        self.seen += len(tokens)

    def update(self, tokens, cues, cycles):
        """After a round: the new tokens, and the cues if a cycle ran since the last update (cycles: its count)."""
        self.observe(tokens, cues if cycles > self.cycles else None)
        self.cycles = cycles

    def candidates(self, ctx):
        """-> [(token, prior)] to follow ctx, likeliest first: retrieval's continuations of the longest suffix
        of ctx seen before, and ctx[-1]'s cues; without either, ctx[-1] again."""
        prior = {}
        for n in range(min(LONGEST, len(ctx)), 0, -1):
            counts = self.follow.get(tuple(ctx[-n:]))
            if counts:
                total = sum(counts.values())
                prior = {t: c / total for t, c in counts.items()}
                break
        for t, p in self.cue.get(ctx[-1], []):
            prior[t] = max(prior.get(t, 0.0), p)
        return sorted(prior.items(), key=lambda x: -x[1]) or [(ctx[-1], 0.0)]

    def draft(self, depth, nodes):
        """-> (tokens, parents) of up to `nodes` draft tokens at most `depth` deep, parents before children; a
        parent is an index into [root] + tokens (0: the root, the last token of the text). Siblings differ. Grown
        best first: a node's children are the tokens that followed the longest earlier occurrence of its context
        (weighted by their share of those occurrences) and its token's cues (weighted by the target's probability),
        a node's score is the product along its path, and the highest scores join until the tree holds `nodes`."""
        tokens = []
        parents = []
        order = 0  # push order: ties in score pop first-pushed first
        width = 1 if self.chain else None  # children a node takes
        frontier = [(-1.0, 0, -1, 0, self.ctx[-LONGEST:])]  # (-score, order, parent, depth, context)
        while frontier and len(tokens) < nodes:
            score, _, parent, d, ctx = heapq.heappop(frontier)
            if parent >= 0:
                tokens.append(ctx[-1])
                parents.append(parent)
            if d < depth:
                for t, p in self.candidates(ctx)[:width]:
                    order += 1
                    heapq.heappush(frontier, (score * p, order, len(tokens), d + 1, ctx + [t]))
        self.last = [self.ctx[-1]] + tokens
        return tokens, parents


def plant(trees, T):
    """Each slot's tree (tokens, parents) from `Retrieval.draft`, None for an empty slot, as the cycle's tensors
    [R, T]: node tokens (-1: no node), parents (node 0, the pending token, is its own), depths, and [R, T, T]
    ancestor-or-self masks."""
    R = len(trees)
    nodes = [[-1] * T for _ in range(R)]
    parent = [[0] * T for _ in range(R)]
    for r, tree in enumerate(trees):
        if tree:
            tokens, parents = tree
            nodes[r][1:len(tokens) + 1] = tokens
            parent[r][1:len(tokens) + 1] = parents
    parent = torch.tensor(parent)  # [R, T]
    rows = torch.arange(R)
    mask = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)  # [R, T, T]
    depth = torch.zeros(R, T, dtype=torch.int64)  # [R, T]
    for j in range(1, T):  # parents come before children
        mask[:, j] |= mask[rows, parent[:, j]]
        depth[:, j] = depth[rows, parent[:, j]] + 1
    return torch.tensor(nodes), parent, depth, mask
