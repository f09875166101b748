"""The device side of decoding: the State a batch's cycles update in place, the methods' rules, and one cycle
function per method over (models, state, shape) with fixed shapes and no host sync, so a CUDA graph can record it,
named by the method's name in CYCLES; then a slot's prefill and graph recording.

    cycle(m, st, shape) = draft_block (K draft steps for every particle) + verify_cycle (the method's cycle: one
                          target forward and the method's rule; then the flags the host reads)
"""
import copy
import math
from dataclasses import dataclass, fields

import torch

import model
import racer

# ---------------------------------------------------------------- decoding state


@dataclass
class Models:
    """What a cycle reads besides its State: the target, the draft (None: none, or racer's host-side drafts), the
    EOS table is_eos [V + 1] (torch.isin sorts, and syncs) and the pad id V, the token an ended particle appends: the
    ids below it are those every method samples from, the pair's shared vocabulary (`target_logits`)."""
    target: model.Transformer
    draft: model.Transformer | None
    is_eos: torch.Tensor
    pad: int
    backend: object  # what runs the cycle's kernels: the target's (the engine builds both models with one)

    @property
    def device(self):
        return self.target.device


@dataclass
class State:
    """Everything a cycle reads and writes: device tensors updated in place, the static buffers a CUDA graph
    replays on. R slots of N particles; each slot has its own settings and rng row, so a request's draws do not
    depend on its neighbours. hist's column 0 is the prompt's last token, column j the j-th generated token; the
    last (x0, column gen_len) is pending: in no cache yet."""
    tcache: model.KVCache  # target: prefix [L, R, Hkv, P, D], suffix [L, R, N, Hkv, S, D]
    dcache: model.KVCache | None  # draft
    rng: torch.Tensor  # [R, 2] seed, counter
    temp_d: torch.Tensor  # [R] the draft's temperature
    temp_t: torch.Tensor  # [R] the target's
    top_k: torch.Tensor  # [R]
    top_p: torch.Tensor  # [R]
    max_new: torch.Tensor  # [R]
    live: torch.Tensor  # [R] a request not done yet: an empty or done slot appends nothing
    degenerate: torch.Tensor  # [R] smc: no particle has weight left
    finished: torch.Tensor  # [R, N] the particle has ended (EOS or stop string)
    hist: torch.Tensor  # [R, N, 1 + H]
    gen_len: torch.Tensor  # [R] tokens generated
    logw: torch.Tensor  # [R, N] smc's log weights since the last resampling
    log_z: torch.Tensor  # [R] smc's log-normaliser estimate
    ess_sum: torch.Tensor  # [R] statistics
    accepted: torch.Tensor  # [R]
    accepted_at: torch.Tensor  # [R, K] draft tokens accepted at each position
    resamples: torch.Tensor  # [R]
    collapses: torch.Tensor  # [R] smc: resamplings forced by the lag
    lag: torch.Tensor  # [R] smc: the most unsettled tokens before a collapse (0: no bound)
    triggers: torch.Tensor  # [R]
    flags: torch.Tensor  # [R, 4] done, settled, degenerate, length: what the host reads each round
    logw_before: torch.Tensor  # [R, N] smc: the last cycle's weights before resampling (traces)
    ancestors: torch.Tensor  # [R, N] smc: each particle's ancestor at the last cycle's resampling (traces)
    drafted: torch.Tensor  # [R, N, K] the draft phase's tokens, which the verify phase reads
    logq: torch.Tensor  # [R, N, K] their log q under the draft temperature
    q_logits: torch.Tensor | None = None  # [R, N, K, V] sd, easd, mdsd: the draft's logits
    nodes: torch.Tensor | None = None  # [R, T] racer's tree from the host: tokens (-1: none; node 0 is x0)
    parent: torch.Tensor | None = None  # [R, T]
    depth: torch.Tensor | None = None  # [R, T]
    mask: torch.Tensor | None = None  # [R, T, T] node j is node i or one of its ancestors
    cues: torch.Tensor | None = None  # [R, T, CUES] the target's top tokens after each node, for the host
    cue_p: torch.Tensor | None = None  # [R, T, CUES] their probabilities

    def narrow(self, n):
        """The first n slots, as views, so that a cycle over them updates self in place."""
        part = copy.copy(self)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, model.KVCache):
                v = copy.copy(v)
                for name in ("prefix_k", "prefix_v", "suffix_k", "suffix_v"):  # [L, R, ...]
                    setattr(v, name, getattr(v, name)[:, :n])
                v.prefix_len = v.prefix_len[:n]
                v.suffix_len = v.suffix_len[:n]
            setattr(part, f.name, v[:n] if torch.is_tensor(v) else v)
        return part


def new_state(m, shape, R, prefix_cap, suffix_cap):
    """A State of R empty slots."""
    N = shape.particles
    K = shape.draft_len
    V = m.pad

    def new(*size, dtype=torch.float32, value=0):
        return torch.full(size, value, dtype=dtype, device=m.device)

    i64 = torch.int64
    i32 = torch.int32
    tcache = model.KVCache(m.target.config, N, prefix_cap, suffix_cap, m.device, m.target.embed.dtype, R)
    dcache = None
    if shape.method.draft_model and m.draft is not None:
        dcache = model.KVCache(m.draft.config, N, prefix_cap, suffix_cap, m.device, m.draft.embed.dtype, R)
    return State(
        tcache=tcache, dcache=dcache, rng=new(R, 2, dtype=i64), temp_d=new(R), temp_t=new(R), top_k=new(R, dtype=i64),
        top_p=new(R, value=1.0), max_new=new(R, dtype=i32), live=new(R, dtype=torch.bool),
        degenerate=new(R, dtype=torch.bool), finished=new(R, N, dtype=torch.bool, value=True),
        hist=new(R, N, 1 + suffix_cap, dtype=i64), gen_len=new(R, dtype=i32), logw=new(R, N), log_z=new(R),
        ess_sum=new(R), accepted=new(R, dtype=i64), accepted_at=new(R, K, dtype=i64), resamples=new(R, dtype=i64),
        collapses=new(R, dtype=i64), lag=new(R, dtype=i32), triggers=new(R, dtype=i64), flags=new(R, 4, dtype=i32),
        logw_before=new(R, N), ancestors=new(R, N, dtype=i64), drafted=new(R, N, K, dtype=i64), logq=new(R, N, K),
        **shape.method.state(new, R, N, K, V, shape))


# ---------------------------------------------------------------- the methods' rules (settings per request: [R])


def per_request(x, like):
    """x [R] viewed to broadcast against like [R, ..., V]."""
    return x.view(-1, *[1] * (like.dim() - 1))


def restrict(logits, temperature, top_k, top_p):
    """logits [R, ..., V] with the tokens outside request r's top-k (top_k [R], 0 = all) and outside its top-p
    nucleus of softmax(logits / T) (top_p [R]) set to -inf: the target distribution every method samples from."""
    ordered, order = logits.sort(-1, descending=True)
    k = per_request(torch.where(top_k > 0, top_k, logits.shape[-1]), logits) - 1
    ordered = ordered.masked_fill(ordered < ordered.gather(-1, k.expand(*logits.shape[:-1], 1)), float("-inf"))
    p = (ordered / per_request(torch.where(temperature > 0, temperature, 1.0), logits)).softmax(-1)
    top_p = per_request(top_p, logits)
    outside = ((top_p < 1) & (p.cumsum(-1) - p >= top_p)) | (ordered == float("-inf"))  # mass before reaches p
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))


def probs(logits, temperature):
    """Sampled distribution at temperature [R] (logits [R, ..., V]): softmax(logits / T), one-hot argmax where T = 0."""
    t = per_request(temperature, logits)
    soft = (logits / torch.where(t > 0, t, 1.0)).softmax(-1)
    return torch.where(t > 0, soft, torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))


def power_bonus(logits, temperature, power):
    """The bonus token's logits for the target p ** power (a sequence-level power of the tempered target: the SMC-SD
    paper's alpha) and its log weight [R, N]: b ~ p(b) ** alpha / Z, whose weight p ** alpha / proposal is Z, log Z =
    logsumexp(alpha l / T) - alpha logsumexp(l / T); logits [R, N, V], temperature [R]. alpha = 1: logits, weight 0."""
    if power == 1:
        return logits, logits.new_zeros(logits.shape[:-1])
    scaled = logits / per_request(temperature, logits)
    return logits * power, (power * scaled).logsumexp(-1) - power * scaled.logsumexp(-1)


def easd_trigger(p, q, t, rule):
    """EASD's rule (arXiv 2512.23765; code unavailable, so defined here): draft token t_k is rejected, replaced by a
    draw from p_k, where both models are uncertain (entropies of p_k, q_k >= `entropy` nats) yet their top-`top` tokens
    mostly agree (>= share x top in common) and include t_k: else it passes. p, q [R, K, V], t [R, K] -> bool [R, K]."""
    entropy, top, share = rule
    uncertain = (entropy_of(p) >= entropy) & (entropy_of(q) >= entropy)  # [R, K]
    top_p = p.topk(top, -1).indices  # [R, K, top]
    top_q = q.topk(top, -1).indices
    shared = (top_p[..., :, None] == top_q[..., None, :]).any(-1)  # [R, K, top]: p's top tokens also q's
    aligned = (shared & (top_p == t[..., None])).any(-1)
    return uncertain & (shared.sum(-1) >= share * top) & aligned


def entropy_of(d):
    """Entropy in nats of distributions d [..., V]."""
    return -(d * d.clamp(min=1e-30).log()).sum(-1)


def bernoulli(m, p, rng):
    """True with probability p [R, M], drawn on the device from each request's rng: a two-way categorical."""
    logits = torch.stack([p.log(), (-p).log1p()], -1)  # [R, M, 2]
    return (m.backend.sample(logits.flatten(0, 1), 1.0, rng)[0] == 0).view(p.shape)


def smc_increments(x0, t, b, logp, logq, finished, is_eos, pad, log_bonus=0.0):
    """smc's weights, EOS absorbing: draft token t_k [R, N, K] weighs log p - log q unless an EOS came before it (in
    x0 [R, N], t_<k, or the particle finished), the bonus b log_bonus [R, N] likewise; after its first EOS a particle's
    tokens become `pad`. -> increments [R, N], tokens [R, N, K+1]. is_eos [V + 1]: a table (torch.isin sorts, syncs)."""
    K = t.shape[-1]
    block = torch.cat([x0[..., None], t, b[..., None]], -1)  # [R, N, K+2]
    ended = (is_eos[block].cumsum(-1) > 0) | finished[..., None]  # an EOS at or before each position
    increments = torch.where(ended[..., :K], 0.0, logp - logq).sum(-1) + torch.where(ended[..., K], 0.0, log_bonus)
    return increments, torch.where(ended[..., :K + 1], pad, block[..., 1:])


# ---------------------------------------------------------------- cycles: fixed shapes, no host sync
# Each cycle function takes the Models m, the State and its batch's Shape.


def pending(st):
    """-> (prev, x0) [R, N]: the history's last two entries."""
    R, N, _ = st.hist.shape
    at = st.gen_len.long()[:, None, None].expand(R, N, 1)
    x = st.hist.gather(2, torch.cat([(at - 1).clamp(min=0), at], -1))
    return x[..., 0], x[..., 1]


def target_logits(m, st, shape, tokens, **tree):
    """The target's step on tokens [R, N, T] (tree: its depth and tree, racer's) -> logits [R, N, T, V] of the ids the
    pair shares, with top-k / top-p applied where some request of the batch asks for them. An ended particle's pad
    goes in as a real id (what it computes is never used); the ids past the shared ones (one model's extra rows,
    padding past the tokenizer) are never drawn, in every method alike, as if their logits were -inf."""
    logits = m.target.step(tokens.clamp(max=m.pad - 1), st.tcache, **tree)[..., :m.pad]
    if shape.restrict:
        logits = restrict(logits, st.temp_t, st.top_k, st.top_p)
    return logits


def publish(st):
    """flags [R, 4] = [done, settled, degenerate, length]: done when every particle has ended, the budget is
    spent or (smc) no weight is left; settled = how many leading tokens all particles share (they can never change
    again, so they may be shown). A done slot is no longer live: it appends nothing until it is refilled."""
    H = st.hist.shape[-1] - 1
    done = st.finished.all(-1) | (st.gen_len >= st.max_new) | st.degenerate  # [R]
    generated = torch.arange(H, device=st.hist.device) < st.gen_len[:, None]  # [R, H]
    shared = (st.hist[..., 1:] == st.hist[:, :1, 1:]).all(1) & generated  # [R, H]
    settled = shared.int().cumprod(-1).sum(-1).int()  # [R]
    st.flags.copy_(torch.stack([done.int(), settled, st.degenerate.int(), st.gen_len], -1))
    st.live &= ~done


def append(m, st, tokens, kept):
    """Commit the first `kept` [R] of tokens [R, N, T] (none where a slot is not live): history, lengths,
    finished. The target holds K/V for the old pending token and the kept tokens but the last."""
    R, N, T = tokens.shape
    kept = kept * st.live
    at = st.gen_len.long()[:, None, None] + 1 + torch.arange(T, device=tokens.device)  # [R, 1, T]
    st.hist.scatter_(2, at.clamp(max=st.hist.shape[-1] - 1).expand(R, N, T), tokens)  # a done slot's stay inside
    st.finished |= (m.is_eos[tokens] & (torch.arange(T, device=tokens.device) < kept[:, None, None])).any(-1)
    st.gen_len += kept
    st.tcache.suffix_len += kept


def draft_block(m, st, shape):
    """K draft steps for every particle, the first on [prev, x0], whose draft K/V the last cycle left unwritten
    -> st.drafted [R, N, K], their log q st.logq, for sd the draft's logits st.q_logits [R, N, K, V]. Advances the
    draft's suffix_len by K + 1."""
    R, N = st.finished.shape
    x = torch.stack(pending(st), -1).clamp(max=m.pad - 1)  # [R, N, 2]: an ended particle's pad as a real id
    for k in range(shape.draft_len):
        out = m.draft.step(x, st.dcache, last_only=True)[..., :m.pad]  # [R, N, V]: the shared ids' (target_logits)
        st.dcache.suffix_len += x.shape[-1]
        t, logq = m.backend.sample(out.flatten(0, 1), st.temp_d, st.rng)  # [R * N]
        x = t.view(R, N, 1)
        st.drafted[..., k] = t.view(R, N)
        st.logq[..., k] = logq.view(R, N)
        if st.q_logits is not None:
            st.q_logits[:, :, k] = out


def ar_cycle(m, st, shape):
    """One target step on the pending token."""
    x0 = pending(st)[1]  # [R, N]
    logits = target_logits(m, st, shape, x0[..., None])[:, 0, 0]  # [R, V]
    token = m.backend.sample(logits, st.temp_t, st.rng)[0]  # [R]
    append(m, st, token.view(-1, 1, 1), torch.ones_like(st.gen_len))


def sd_cycle(m, st, shape):
    """Speculative sampling over N drafts of K tokens from one prefix (sd: N = 1; mdsd: SpecInfer's and SpecTr's
    multi-draft rule), each request accepting its own count. Depth by depth, over the particles whose drafts so far
    are the accepted ones (viable), their tokens c are tried in turn, accepted with probability min(1, r(c)/q(c)),
    r starting as p and becoming normalise(max(r - q, 0)) after each rejection; an accepted token keeps the
    particles that drafted it. No acceptance emits a draw from r; K acceptances a bonus token from p. Exact at any
    temperature. easd (N = 1) also rejects where `easd_trigger` fires, r then being p (not exact: it trades
    the draft's low-confidence agreement for the target). Every particle then takes the winner's K/V."""
    K = shape.draft_len
    R, N = st.finished.shape
    device = st.gen_len.device
    block = torch.cat([pending(st)[1][..., None], st.drafted], -1)  # [R, N, K+1]: x0, t_1..t_K
    p = probs(target_logits(m, st, shape, block), st.temp_t)  # [R, N, K+1, V]: row k - 1 scores t_k, row K the bonus
    q = probs(st.q_logits, st.temp_d)  # [R, N, K, V]
    rows = torch.arange(R, device=device)
    viable = torch.ones(R, N, dtype=torch.bool, device=device)  # [R, N] the drafts equal to what was accepted
    going = st.live.clone()  # [R] no rejection yet
    out = st.drafted[:, 0].clone()  # [R, K] the accepted tokens
    n = torch.zeros(R, dtype=torch.long, device=device)  # [R] how many
    fix = p[:, 0, K]  # [R, V] the distribution the emitted token is drawn from
    for k in range(K):
        lead = viable.int().argmax(-1)  # [R] a viable particle: its rows are every viable one's
        pk = p[rows, lead, k]  # [R, V]
        qk = q[rows, lead, k]  # [R, V]
        c = st.drafted[..., k]  # [R, N]
        triggered = None
        if shape.easd:
            triggered = easd_trigger(pk[:, None], qk[:, None], c[:, :1], shape.easd)[:, 0]  # [R]
        r = pk
        ratios = []
        for i in range(N):
            rc = r.gather(1, c[:, i:i + 1])[:, 0]  # [R]
            qc = qk.gather(1, c[:, i:i + 1])[:, 0]
            ok = viable[:, i]
            if triggered is not None:
                ok = ok & ~triggered
            ratios.append(torch.where(rc >= qc, 1.0, rc / qc) * ok)
            residual = (r - qk).clamp(min=0)
            if triggered is not None:  # easd: where its rule fired, the token is drawn from p
                residual = torch.where(triggered[:, None], pk, residual)
            total = residual.sum(-1, keepdim=True)
            r = torch.where(viable[:, i, None] & (total > 0), residual / total, r)  # r == q: nothing to fix
        accept = bernoulli(m, torch.stack(ratios, -1), st.rng)  # [R, N]: the first one counts
        won = c.gather(1, accept.int().argmax(-1, keepdim=True))[:, 0]  # [R]
        stop = going & ~accept.any(-1)
        fix = torch.where(stop[:, None], r, fix)
        if triggered is not None:
            st.triggers += stop & triggered
        going &= ~stop
        out[:, k] = torch.where(going, won, out[:, k])
        n = n + going
        st.accepted_at[:, k] += going
        viable &= ~going[:, None] | (c == won[:, None])
    winner = viable.int().argmax(-1)  # [R]
    fix = torch.where(going[:, None], p[rows, winner, K], fix)  # all K accepted: the bonus
    last = m.backend.sample(fix.log(), 1.0, st.rng)[0]  # [R]
    accepted = torch.cat([out, last[:, None]], 1)  # [R, K+1]
    tokens = torch.where(torch.arange(K + 1, device=device) < n[:, None], accepted, last[:, None])  # then filler
    if N > 1:  # the rows this cycle wrote, from the winner (the rows before are every particle's already)
        for cache, start in ((st.tcache, st.tcache.suffix_len), (st.dcache, st.dcache.suffix_len - K - 1)):
            for kv in (cache.suffix_k, cache.suffix_v):
                copy_rows(kv, winner, start, K + 1)
    st.dcache.suffix_len -= K - n  # the draft keeps K/V up to t_{n-1}
    st.accepted += n
    append(m, st, tokens[:, None].expand(R, N, K + 1), n + 1)


def copy_rows(kv, source, start, T):
    """kv [L, R, N, Hkv, S, D]: rows start .. start + T - 1 [R] of every particle become particle source's [R]."""
    L, R, N, H, S, D = kv.shape
    at = (start.long()[:, None] + torch.arange(T, device=kv.device)).clamp(max=S - 1).view(1, R, 1, 1, T, 1)
    block = kv.gather(4, at.expand(L, R, N, H, T, D))  # [L, R, N, H, T, D]
    chosen = block.gather(2, source.view(1, R, 1, 1, 1, 1).expand(L, R, 1, H, T, D))  # [L, R, 1, H, T, D]
    kv.scatter_(4, at.expand(L, R, N, H, T, D), chosen.expand(L, R, N, H, T, D))


def racer_cycle(m, st, shape):
    """sd on racer's draft tree, verified exactly in one target forward: a node sees the prefix, its ancestors
    and itself (st.mask), at position length + depth. From the root, y ~ p is drawn at each node and the child
    whose token is y followed, else y emitted: the text follows p exactly (greedy: ar's tokens), a chain being the
    tree of one child per node. The path's K/V then moves down; each node's top tokens become the host's cues."""
    R, T = st.nodes.shape
    K = shape.draft_len
    device = st.gen_len.device
    nodes = torch.cat([pending(st)[1][:, :1], st.nodes[:, 1:]], 1)  # [R, T]: -1 marks no node
    base = st.tcache.suffix_len.clone()
    logits = target_logits(m, st, shape, nodes.clamp(min=0)[:, None], depth=st.depth, tree=st.mask)[:, 0]  # [R, T, V]
    y = m.backend.sample(logits.flatten(0, 1), st.temp_t, st.rng)[0].view(R, T)  # a draw from p at every node
    follows = (nodes == y.gather(1, st.parent)) | (torch.arange(T, device=device) == 0)  # [R, T]
    on_path = ~(st.mask & ~follows[:, None]).any(-1)  # [R, T]: the node and all its ancestors followed
    d = torch.arange(K + 1, device=device)
    path = (on_path[:, None] & (st.depth[:, None] == d[:, None])).int().argmax(-1)  # [R, K+1]: 0 past the end
    n = (st.depth * on_path).amax(-1)  # [R] draft tokens accepted
    last = y.gather(1, path.gather(1, n[:, None]))[:, 0]  # [R] the last node's draw
    accepted = torch.cat([nodes.gather(1, path[:, 1:]), last[:, None]], 1)  # [R, K+1]
    tokens = torch.where(d < n[:, None], accepted, last[:, None])
    m.backend.compact(st.tcache, base, path)
    top = logits.topk(racer.CUES)  # their probabilities without a softmax over the vocabulary
    st.cues.copy_(top.indices)
    st.cue_p.copy_((top.values - logits.logsumexp(-1, keepdim=True)).exp())
    st.accepted_at += torch.arange(K, device=device) < n[:, None]
    st.accepted += n
    append(m, st, tokens[:, None], n.int() + 1)


def smc_cycle(m, st, shape):
    """Weight each particle's K drafted tokens by one target forward, append K + 1 tokens (the last a bonus
    token from the target), resample where the ESS falls below the threshold. A power target p ** alpha
    (shape.power) weighs a draft token alpha log p - log q (`power_bonus`)."""
    K = shape.draft_len
    R, N = st.finished.shape
    t = st.drafted  # [R, N, K]
    x0 = pending(st)[1]  # [R, N]
    logits = target_logits(m, st, shape, torch.cat([x0[..., None], t], -1))  # [R, N, K+1, V]: row k - 1 scores t_k
    logp = m.backend.token_logprobs(logits[:, :, :K].flatten(0, 2), t.flatten(), st.temp_t).view(R, N, K)
    bonus, log_bonus = power_bonus(logits[:, :, K], st.temp_t, shape.power)
    b = m.backend.sample(bonus.flatten(0, 1), st.temp_t, st.rng)[0].view(R, N)
    increments, tokens = smc_increments(x0, t, b, shape.power * logp, st.logq, st.finished, m.is_eos, m.pad,
                                        log_bonus)
    st.logw += increments
    append(m, st, tokens, torch.full_like(st.gen_len, K + 1))
    resample(m, st, shape)


def resample(m, st, shape):
    """Systematic resampling of each slot whose ESS < threshold * N: each particle's suffix K/V (target and
    draft), history and finished flag become its ancestor's; the log-normaliser takes the mean weight and the
    weights restart at 0. A population with no positive weight, or a NaN one, is degenerate: resampling it would
    be a uniform draw that hides the failure, so the request ends. A slot whose unsettled text exceeds its lag
    (st.lag, 0: none) collapses onto one particle drawn in proportion to its weight (each particle's expected
    copies are still N x its weight: unbiased), so that text keeps streaming where the weights never degenerate."""
    ancestors, ess, resampled, degenerate = m.backend.resample(st.logw, shape.ess_threshold, st.rng)
    lagging = st.live & (st.lag > 0) & (st.gen_len - st.flags[:, 1] > st.lag) & ~resampled  # [R]
    one = m.backend.sample(st.logw, 1.0, st.rng)[0].clamp(max=shape.particles - 1)  # [R] a particle drawn by weight
    ancestors = torch.where(lagging[:, None], one[:, None], ancestors)  # [R, N]
    resampled = resampled | lagging
    st.degenerate |= degenerate & st.live
    st.logw_before.copy_(st.logw)
    st.ancestors.copy_(ancestors)
    st.log_z += torch.where(resampled, st.logw.logsumexp(-1) - math.log(shape.particles), 0.0)
    st.logw.masked_fill_(resampled[:, None], 0.0)
    for cache in (st.tcache, st.dcache):
        for kv in (cache.suffix_k, cache.suffix_v):
            m.backend.gather_suffix(kv, ancestors, cache.suffix_len)
    m.backend.gather_suffix(st.hist, ancestors, st.gen_len + 1)
    st.finished.copy_(st.finished.gather(1, ancestors))
    st.resamples += resampled
    st.collapses += lagging
    st.ess_sum += ess


# Each method's cycle after drafting, by its name (racer: sd on racer's drafts): its rule. The methods' objects
# (methods.py) hold the rest: defaults, checks, State tensors, costs, statistics.
CYCLES = {"ar": ar_cycle, "sd": sd_cycle, "mdsd": sd_cycle, "easd": sd_cycle, "racer": racer_cycle, "smc": smc_cycle}


def verify_cycle(m, st, shape):
    """The cycle after drafting: the method's (CYCLES), then the flags."""
    CYCLES[shape.method.name](m, st, shape)
    if st.dcache is not None:
        st.dcache.suffix_len.mul_(st.live)  # a slot that is not live drafted into nothing
    publish(st)


def cycle(m, st, shape):
    """One cycle of shape's method over the slots of st, then their flags for the host: its phases in turn."""
    for phase in phases(st):
        phase(m, st, shape)


def phases(st):
    """The functions a cycle runs, in order: the draft block where a draft model drafts, then the verify."""
    if st.dcache is None:
        return (verify_cycle,)
    return (draft_block, verify_cycle)


def record(fn):
    """-> the replay of a CUDA graph of fn(), run once first on a side stream (Triton compiles, cuBLAS picks its
    kernels) so that the capture records warm kernels. Each graph is captured on a stream of its own: cuBLAS keeps a
    workspace per stream, which graphs captured on torch's one capture stream would share, and MineDraft's halves
    replay theirs at once; a graph freed with its batch then frees no workspace that another replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph.replay


def graphs(shape, device):
    """Whether cycles replay CUDA graphs (a function of its own, so that a test can take that path on a CPU)."""
    return shape.cuda_graphs and device.type == "cuda"



# ---------------------------------------------------------------- slots and memory


def prefill_slot(m, st, shape, r, req):
    """req into slot r: its prompt into the target's prefix cache, its settings, each particle's x0 from the target
    (published: the first token can stream before `prefill_draft`, which decoding needs next)."""
    settings = req.settings
    N = shape.particles
    prompt = torch.tensor(req.ids, device=st.hist.device)
    logits = m.target.prefill(prompt, st.tcache, r, on_layer=req.on_prefill)[:m.pad]  # [V]: the shared ids'
    st.rng[r] = torch.tensor([settings.seed, 0])
    st.temp_d[r] = settings.draft_temperature
    st.temp_t[r] = settings.target_temperature
    st.top_k[r] = settings.top_k
    st.top_p[r] = settings.top_p
    logits, log_first = power_bonus(logits.expand(1, N, -1), st.temp_t[r:r + 1], settings.power)  # [1, N, V]
    st.log_z[r] = log_first[0, 0]  # the first token's normaliser, the same for every particle
    if shape.restrict:
        logits = restrict(logits, st.temp_t[r:r + 1], st.top_k[r:r + 1], st.top_p[r:r + 1])
    x0 = m.backend.sample(logits[0], st.temp_t[r:r + 1], st.rng[r:r + 1])[0]  # [N]
    if not shape.method.weighted:  # only smc's particles part at once
        x0 = x0[:1].expand(N)
    st.hist[r] = 0
    st.hist[r, :, 0] = prompt[-1]
    st.hist[r, :, 1] = x0
    st.gen_len[r] = 1
    st.max_new[r] = settings.max_new_tokens
    st.finished[r] = m.is_eos[x0]
    st.live[r] = True
    st.lag[r] = settings.lag
    for x in (st.degenerate, st.logw, st.ess_sum, st.accepted, st.accepted_at, st.resamples, st.collapses, st.triggers):
        x[r] = 0
    publish(st)


def prefill_draft(m, st, r, req):
    """req's prompt into the draft's prefix cache of slot r (none without a draft model): all but its last token,
    which the first draft step takes beside x0."""
    if st.dcache is None:
        return
    st.dcache.prefix_len[r] = 0  # a one-token prompt leaves it empty
    st.dcache.suffix_len[r] = 0
    if len(req.ids) > 1:
        m.draft.prefill(torch.tensor(req.ids[:-1], device=st.hist.device), st.dcache, r, logits=None)


def plant(st, requests, shape):
    """Racer, before a cycle: each busy slot's draft tree, grown on the host by its request's drafter, into the
    cycle's tensors (requests: the batch's, None for an empty slot)."""
    trees = [req and req.drafter.draft(shape.draft_len, shape.tree) for req in requests]
    for x, value in zip((st.nodes, st.parent, st.depth, st.mask), racer.plant(trees, st.nodes.shape[1])):
        x.copy_(value)


def empty_slot(st, r):
    """Slot r holds no request: it appends nothing and its caches are empty."""
    for cache in (st.tcache, st.dcache):
        if cache is not None:
            cache.prefix_len[r] = 0
            cache.suffix_len[r] = 0
    st.live[r] = False
    st.gen_len[r] = 0
    st.finished[r] = True
    st.degenerate[r] = False
    st.logw[r] = 0


def pick(m, st, r, select):
    """Slot r's returned particle: one drawn in proportion to its weight ("sample"), or the heaviest."""
    if select == "sample":
        return int(m.backend.sample(st.logw[r:r + 1], 1.0, st.rng[r:r + 1])[0][0])
    return int(st.logw[r].argmax())
