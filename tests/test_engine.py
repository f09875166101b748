"""engine.py on tiny random models: exact output distributions of ar, sd and smc against the target's, computed
by enumerating every continuation; the SMC-SD pitfalls (docs/design.md); bad input; the command line."""
import copy
import functools
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import cli
import decode
import engine
import errors
import formats
import kernels
import loading
import methods
import model
import platforms
import racer
import scheduler
import settings
from cpu import auto, native
from cpu import formats as cpu_formats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, PROMPT = 8, [1, 2, 3]


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The PyTorch reference kernels, as on CPU (the interpreted Triton ones are 1000x slower; one test below
    runs them); one thread, since tiny models drown in thread hand-offs."""
    monkeypatch.setattr(kernels, "INTERPRET", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def requests_of(e, prompts, **options):
    """Checked Requests of prompts (text, ids or {"prompt": ..., **options}), as generate's list form makes them."""
    return engine.prepared(e, engine.items_of(prompts, options))


def tiny(seed, scale=1.0, vocab=V, eos=(), head_dim=8, device="cpu"):
    c = model.Config(arch="llama", vocab_size=vocab, dim=2 * head_dim, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=head_dim, ffn_dim=32, max_seq_len=64, eos_ids=list(eos))
    m = model.Transformer(c, device, torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)  # drawn on the CPU: the same model anywhere
    return m


def perturbed(m, seed, amount):
    """A draft that resembles m: its weights plus `amount` times another random model's."""
    draft, noise = copy.deepcopy(m), tiny(seed, 0.8, m.config.vocab_size, head_dim=m.config.head_dim)
    with torch.no_grad():
        for p, n in zip(draft.parameters(), noise.parameters()):
            p.add_(amount * n.to(p.device))
    return draft


TARGET = tiny(0, 0.8)  # about 8 likely continuations of 4 tokens at temperature 0.7, 80 at 1.0
DRAFT = perturbed(TARGET, 1, 0.3)  # total variation to the target: 0.98 at temperature 0.7, 0.93 at 1.0


# ---------------------------------------------------------------- exact distributions


def exact(m, length, temperature, vocab=None):
    """Probability of every continuation of PROMPT of `length` tokens at `temperature`, [V ** length], indexed by
    the continuation read as a base-V number (V: vocab, the ids sampled, m's first ones; None: all of m's), computed
    in m's own weights and activations."""
    vocab = vocab or m.config.vocab_size
    contexts = torch.cartesian_prod(*[torch.arange(vocab)] * (length - 1))  # [M, length-1], lexicographic
    cache = model.KVCache(m.config, len(contexts), len(PROMPT), length, "cpu", m.embed.dtype)
    first = (m.prefill(torch.tensor(PROMPT), cache)[:vocab].float() / temperature).log_softmax(-1)  # [V]
    rest = (m.step(contexts[None], cache)[0, ..., :vocab].float() / temperature).log_softmax(-1)  # [M, length-1, V]
    logp = first[contexts[:, 0]] + rest[:, :-1].gather(2, contexts[:, 1:, None])[..., 0].sum(-1)
    return (logp[:, None] + rest[:, -1]).exp().flatten()


def outcome(tokens, vocab=V):
    return sum(t * vocab ** i for i, t in enumerate(reversed(tokens)))


def forked(fn):
    """Start fn() in a forked copy of this process (its models, patches and all) on the second core, which these
    one-thread tests leave idle -> a function that waits for fn's result."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send(fn()), daemon=True)
    child.start()
    send.close()

    def result():
        assert receive.poll(600), "the fork ran for 10 minutes"
        out = receive.recv()  # EOFError where fn raised in the fork: its traceback is in the captured stderr
        child.join()
        return out
    return result


def empirical(e, samples, length, **options):
    """The frequency of every continuation over seeds 0, 1, ..., decoded 64 requests at a time, half of them in a
    fork (each request's draws are its own: alone, in a batch or in another process, the same tokens)."""
    def tokens(seeds):
        requests = [dict(prompt=PROMPT, seed=seed) for seed in seeds]
        return [r.tokens for r in e.generate(requests, slots=64, max_new_tokens=length, **options)]
    rest = forked(lambda: tokens(range(samples // 2, samples)))
    found = tokens(range(samples // 2)) + rest()
    assert len(found) == samples and all(len(t) == length for t in found)
    vocab = e.vocab
    return torch.bincount(torch.tensor([outcome(t, vocab) for t in found]), minlength=vocab ** length) / samples


def tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


def noise_floor(p, samples, quantile=0.99):
    """The TV distance between p and the empirical distribution of `samples` draws from p, at a quantile."""
    g = torch.Generator().manual_seed(0)
    draws = [tv(p, torch.bincount(torch.multinomial(p, samples, True, generator=g), minlength=len(p)) / samples)
             for _ in range(200)]
    return torch.tensor(draws).quantile(quantile).item()


SAMPLES, K = 1500, 2  # continuations of 2K tokens: x0, then one cycle's t_1, t_2 and bonus token


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "sd"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_ar_and_sd_sample_the_target_distribution(method, temperature):
    target = exact(TARGET, 2 * K, temperature)
    e = engine.Engine.of_models(TARGET, DRAFT)
    found = empirical(e, SAMPLES, 2 * K, method=method, temperature=temperature, draft_len=K)
    floor = noise_floor(target, SAMPLES)
    print(f"{method} T={temperature}: TV {tv(found, target):.3f}, noise floor {floor:.3f}")
    assert tv(found, target) < floor


@pytest.mark.slow
@pytest.mark.parametrize("particles, draft_len", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_mdsd_samples_the_target_distribution(particles, draft_len):
    """Multi-draft speculative sampling over N particles is exact: 4 tokens are x0 and two cycles at K = 1 (the
    second after every particle took the winner's state), x0 and one whole cycle at K = 2."""
    target = exact(TARGET, 4, 1.0)
    found = empirical(engine.Engine.of_models(TARGET, DRAFT), SAMPLES, 4, method="mdsd", particles=particles,
                      draft_len=draft_len, temperature=1.0)
    assert tv(found, target) < noise_floor(target, SAMPLES)


def in_format(m, fmt):
    """A copy of m with its matmul weights in weight format fmt and its activations in that format's dtype, as the
    CPU platform converts and runs it."""
    out = model.Transformer(m.config, "cpu", formats.FORMATS[fmt], platforms.Cpu("cpu").backend)
    out.load_state_dict(m.state_dict())
    cpu_formats.convert_weights(out, fmt)
    return out


WIDE = tiny(2, 0.8, vocab=16, head_dim=16)  # int4 packs 16 output rows (the head's: the vocabulary) and 32 inputs


@pytest.mark.parametrize("fmt, draft_fmt, method", [("bf16", "bf16", "sd"), ("int8", "int8", "mdsd"),
                                                    ("int4", "int4", "sd"), ("int4", "int4", "mdsd"),
                                                    ("float32", "int4", "sd"),
                                                    ("float32", "int4", "mdsd"), ("w4a8", "w4a8", "sd"),
                                                    ("w4a8", "w4a8", "mdsd")])
@pytest.mark.slow
def test_exact_methods_sample_the_target_in_every_weight_format(fmt, draft_fmt, method):
    """sd and mdsd sample the target's distribution in the weights it has (3 tokens: x0 and one cycle at K = 1):
    the quantized or bf16 target's own exact distribution, computed in its own weights and activations; a draft
    in another format (auto's choice per model: other activations, its own KV cache's dtype) changes nothing."""
    target, draft = in_format(WIDE, fmt), in_format(perturbed(WIDE, 3, 0.3), draft_fmt)
    p = exact(target, 3, 1.0)
    shape = dict(particles=3) if method == "mdsd" else {}
    e = engine.Engine.of_models(target, draft)
    found = empirical(e, SAMPLES, 3, method=method, draft_len=1, temperature=1.0, **shape)
    assert tv(found, p) < noise_floor(p, SAMPLES)


def test_memory_check_counts_each_cache_in_its_models_dtype():
    """The bytes a batch is checked against are its KV caches' as made (a float32 target's, an int4 draft's in bf16)
    plus the logits' allowance."""
    e = engine.Engine.of_models(in_format(WIDE, "float32"), in_format(WIDE, "int4"))
    with torch.inference_mode():
        _, st, s = started(e, method="sd", draft_len=2, max_new_tokens=8)
    made = sum(t.nbytes for c in (st.tcache, st.dcache) for t in (c.prefix_k, c.prefix_v, c.suffix_k, c.suffix_v))
    logits = 4 * s.particles * (s.draft_len + 1) * WIDE.config.vocab_size * 4
    assert scheduler.batch_bytes(e, s, 1, (len(PROMPT), st.hist.shape[2] - 1)) == made + logits


def test_mdsd_with_one_draft_is_sd_and_greedy_is_ar():
    e = engine.Engine.of_models(TARGET, DRAFT)
    for seed in range(3):
        sd = e.generate(PROMPT, method="sd", max_new_tokens=12, seed=seed, draft_len=3)
        one = e.generate(PROMPT, method="mdsd", particles=1, max_new_tokens=12, seed=seed, draft_len=3)
        assert one.tokens == sd.tokens and one.stats["accepted"] == sd.stats["accepted"]
    ar = e.generate(PROMPT, method="ar", temperature=0, max_new_tokens=30)
    for particles in (2, 4):
        assert e.generate(PROMPT, method="mdsd", particles=particles, temperature=0, max_new_tokens=30).tokens == \
            ar.tokens


def test_sd_with_a_greedy_draft_is_exact():
    """Any proposal works: a greedy draft against a sampling target is still exact."""
    target = exact(TARGET, 2 * K, 1.0)
    e = engine.Engine.of_models(TARGET, DRAFT)
    found = empirical(e, SAMPLES, 2 * K, method="sd", draft_temperature=0, target_temperature=1.0, draft_len=K)
    assert tv(found, target) < noise_floor(target, SAMPLES)


@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_greedy_sd_equals_greedy_ar(draft_len):
    e = engine.Engine.of_models(TARGET, DRAFT)
    ar = e.generate(PROMPT, method="ar", temperature=0, max_new_tokens=40)
    sd = e.generate(PROMPT, method="sd", temperature=0, max_new_tokens=40, draft_len=draft_len)
    assert sd.tokens == ar.tokens and len(ar.tokens) == 40
    # the prefill's token, then per cycle the accepted draft tokens and one of the target's, the last cycle's cut
    cycles, accepted = sd.stats["cycles"], sd.stats["accepted"]
    assert 40 <= 1 + accepted + cycles < 40 + draft_len + 1 and accepted > 0
    assert sd.stats["acceptance"] == round(accepted / (cycles * draft_len), 4)


def test_the_first_token_streams_before_the_drafts_prefill(monkeypatch):
    """The target's prefill gives the first token: it settles and streams before the draft reads the prompt (a long
    prompt's draft prefill would hold it back), and a request it ends never runs the draft's prefill."""
    events = []

    def record(m):
        prefill = m.prefill
        monkeypatch.setattr(m, "prefill", lambda *a, **k: events.append("draft prefill") or prefill(*a, **k))
        return m
    e = engine.Engine.of_models(TARGET, record(copy.deepcopy(DRAFT)))
    options = dict(method="sd", temperature=0, max_new_tokens=6, draft_len=2)
    sd = e.generate(PROMPT, on_tokens=lambda tokens: events.append(len(tokens)), **options)
    assert events[:2] == [1, "draft prefill"] and events.count("draft prefill") == 1
    assert sd.tokens == e.generate(PROMPT, method="ar", temperature=0, max_new_tokens=6).tokens
    events.clear()
    one = e.generate(PROMPT, **options | {"max_new_tokens": 1})
    ends = engine.Engine.of_models(tiny(0, 0.8, eos=range(V)), record(copy.deepcopy(DRAFT)))  # TARGET, every id EOS
    first = ends.generate(PROMPT, **options)
    assert one.tokens == sd.tokens[:1] and first.stats["stop"] == "eos" and "draft prefill" not in events


@pytest.mark.slow
def test_easd_is_sd_where_its_rule_never_fires_and_draws_from_the_target_where_it_does():
    """easd with an entropy no distribution reaches is sd token for token; where the rule fires on every draft
    token (entropy 0, the whole vocabulary as the top set) each cycle emits one draw from the target, so the output
    follows the target's distribution exactly and every cycle counts one rejection."""
    e = engine.Engine.of_models(TARGET, DRAFT)
    for seed in range(3):
        sd = e.generate(PROMPT, method="sd", max_new_tokens=12, seed=seed, draft_len=3)
        never = e.generate(PROMPT, method="easd", max_new_tokens=12, seed=seed, draft_len=3, easd=(1e9, 5, 0.6))
        assert never.tokens == sd.tokens and never.stats["triggers"] == 0
    always = dict(method="easd", temperature=1.0, draft_len=K, easd=(0.0, V, 0.0))
    found = empirical(e, SAMPLES, 2 * K, **always)
    assert tv(found, exact(TARGET, 2 * K, 1.0)) < noise_floor(exact(TARGET, 2 * K, 1.0), SAMPLES)
    stats = e.generate(PROMPT, max_new_tokens=8, **always).stats
    assert stats["triggers"] == stats["cycles"] == 7 and stats["trigger_rate"] == 1.0 and stats["accepted"] == 0


def test_racer_drafts_keep_sd_exact():
    """--draft racer: chains from retrieval and logit cues, no draft model, verified exactly (draw y ~ p, keep the
    draft token if it is y, else emit y), so sd still samples the target exactly, and greedy sd equals ar."""
    e = engine.Engine.of_models(TARGET, "racer")
    found = empirical(e, SAMPLES, 2 * K, method="sd", temperature=1.0, draft_len=K)
    assert tv(found, exact(TARGET, 2 * K, 1.0)) < noise_floor(exact(TARGET, 2 * K, 1.0), SAMPLES)
    greedy = dict(temperature=0, max_new_tokens=30)
    racer = e.generate(PROMPT, method="sd", draft_len=3, **greedy)
    assert racer.tokens == e.generate(PROMPT, method="ar", **greedy).tokens and racer.stats["accepted"] > 0
    for method in ("smc", "easd"):
        with pytest.raises(errors.UsageError, match=f"{method} needs a draft model"):
            e.generate(PROMPT, method=method)


def random_tree(seed, depth, nodes):
    """A Retrieval.draft stand-in: a random tree of `nodes` tokens at most `depth` deep, siblings distinct,
    parents before children."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents, depths, children = [], [], [0], {0: set()}
    while len(tokens) < nodes:
        parent = int(torch.randint(len(depths), (1,), generator=g))
        free = [t for t in range(V) if t not in children[parent]]
        if depths[parent] < depth and free:
            t = free[int(torch.randint(len(free), (1,), generator=g))]
            children[parent].add(t)
            children[len(depths)] = set()
            tokens, parents, depths = tokens + [t], parents + [parent], depths + [depths[parent] + 1]
    return tokens, parents


@pytest.fixture
def random_trees(monkeypatch):
    """Every racer cycle verifies a random tree, a function of the request's text so far (so a request's trees
    do not depend on its neighbours): all its branches, at every depth, get their turn."""
    def draft(self, depth, nodes):
        tokens, parents = random_tree(hash(tuple(self.ctx)) % 2**31, depth, nodes)
        self.last = [self.ctx[-1]] + tokens
        return tokens, parents
    monkeypatch.setattr(racer.Retrieval, "draft", draft)


def test_racer_tree_drafts_keep_sd_exact(random_trees):
    """Tree drafts verified in one forward (tree mask, position = length + depth), walked down by draws from p,
    the path's K/V compacted: the target's distribution at any tree, and greedy ar's tokens."""
    e = engine.Engine.of_models(TARGET, "racer")
    target = exact(TARGET, 2 * K, 1.0)
    found = empirical(e, SAMPLES, 2 * K, method="sd", temperature=1.0, draft_len=K, tree=6)
    assert tv(found, target) < noise_floor(target, SAMPLES)
    greedy = dict(method="sd", temperature=0, max_new_tokens=30, draft_len=3)
    tree = e.generate(PROMPT, tree=12, **greedy)
    assert tree.tokens == e.generate(PROMPT, method="ar", temperature=0, max_new_tokens=30).tokens
    accepted, cycles = tree.stats["accepted"], tree.stats["cycles"]  # a path of at most 3 and a token a cycle
    assert 30 <= 1 + accepted + cycles < 30 + 3 + 1 and accepted > 0


def test_racer_tree_cycles_leave_the_kv_of_the_text(random_trees):
    """After tree cycles the target's suffix K/V are those of a fresh prefill of the text (the accepted path
    moved down, the rest overwritten in later cycles); a request in a batch decodes as alone."""
    e = engine.Engine.of_models(TARGET, "racer")
    with torch.inference_mode():
        req = e.request(PROMPT, method="sd", max_new_tokens=20, temperature=1.0, draft_len=3, tree=9)
        b = scheduler.Batch(e.load().models, req.shape, 1, len(PROMPT), req.capacity)
        b.admit(req)
        for _ in range(4):
            b.cycle()
            b.collect()
        st, n = b.st, int(b.st.gen_len[0])
        assert int(st.tcache.suffix_len[0]) == n - 1 and int(st.accepted[0]) == n - 1 - req.cycles  # +1 a cycle
        tokens = PROMPT + st.hist[0, 0, 1:n].tolist()
        fresh = model.KVCache(TARGET.config, 1, len(tokens), 1, "cpu", torch.float32)
        TARGET.prefill(torch.tensor(tokens), fresh)
        assert torch.allclose(st.tcache.suffix_k[:, 0, 0, :, :n - 1], fresh.prefix_k[:, 0, :, len(PROMPT):],
                              atol=1e-5)
    requests = mixed_requests("sd")
    alone = [e.generate(method="sd", draft_len=2, tree=5, **r).tokens for r in requests]
    assert [r.tokens for r in e.generate(requests, method="sd", draft_len=2, tree=5, slots=2)] == alone


@pytest.mark.parametrize("tree", [0, 2, 7])
def test_racer_on_the_graph_path_and_at_the_end_of_its_budget(monkeypatch, tree):
    """The CUDA-graph path (recording swapped for an eager warm-up, as above) plants each cycle's tree into the
    recorded tensors: the eager tokens. Budgets that end inside a cycle's block, trees smaller than K: the
    history and the K/V stay inside the slot."""
    e = engine.Engine.of_models(TARGET, "racer")
    for budget in (1, 2, 5, 9):
        options = dict(method="sd", max_new_tokens=budget, seed=2, draft_len=4, tree=tree, temperature=1.0)
        eager = e.generate(PROMPT, **options)
        with monkeypatch.context() as m:
            m.setattr(decode, "record", lambda fn: fn() or fn)
            m.setattr(decode, "graphs", lambda shape, device: True)
            assert e.generate(PROMPT, **options).tokens == eager.tokens and len(eager.tokens) == budget


def test_racer_retrieval_follows_the_longest_earlier_suffix():
    r = racer.Retrieval([5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2])
    # "1 2" was followed by 3 both times; "1 2 3" by 4 and by 7 (a tie: the first seen); then "1 2 3 4" by 9, 1
    assert r.draft(4, 4) == ([3, 4, 9, 1], [0, 1, 2, 3])
    # the target's top tokens after the root (2) and after each drafted one
    r.observe([3, 8], [([6, 5, 0, 0], [0.5, 0.2, 0, 0]), ([7, 0, 0, 0], [0.9, 0, 0, 0])])
    assert r.cue[2] == [(6, 0.5), (5, 0.2), (0, 0), (0, 0)] and r.cue[3][0] == (7, 0.9) and r.seen == 2
    assert r.draft(1, 1) == ([8], [0])  # "8" unseen, no cue: repeat it
    r.cue[8] = [(4, 0.3)]
    assert r.draft(1, 1) == ([4], [0])


def test_racer_trees_grow_best_first():
    """Children: retrieval's continuations weighted by their share, cues by the target's probability; the best
    products join first, siblings differ, parents come before children, the depth and node budget hold."""
    r = racer.Retrieval([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], chain=False)  # "1 2" -> 3 (2/3), 4 (1/3)
    r.cue[3] = [(5, 0.9), (1, 0.5)]  # after "1 2 3": retrieval says 1 (every time), the cues 5 (0.9) and 1
    tokens, parents = r.draft(2, 4)
    assert list(zip(tokens, parents)) == [(3, 0), (1, 1), (5, 1), (4, 0)]  # 2/3, 2/3 * 1, 2/3 * 0.9, 1/3
    tokens, parents = r.draft(3, 64)
    depth = [0]
    for t, p in zip(tokens, parents):
        assert p < len(depth)
        depth.append(depth[p] + 1)
    assert max(depth) <= 3 and len(tokens) <= 64
    assert all(len({t for t, p in zip(tokens, parents) if p == q}) == parents.count(q) for q in set(parents))


def test_smc_with_draft_equal_to_target():
    """Zero weight increments (the target log-prob is taken at the target temperature, 0.7 here, as the draft's
    is), hence no resampling (without a lag), and the target distribution. Several cycles: a draft missing the K/V
    of t_K and the bonus token would see another context than the target and weigh it."""
    e = engine.Engine.of_models(TARGET, TARGET)
    long = e.generate(PROMPT, method="smc", particles=8, draft_len=3, max_new_tokens=30, temperature=0.7, lag=0)
    assert long.stats["resamples"] == 0 and long.stats["mean_ess"] == 8
    assert abs(long.stats["log_z"]) < 1e-4
    target = exact(TARGET, 2 * K, 0.7)
    found = empirical(e, SAMPLES, 2 * K, method="smc", particles=4, draft_len=K, temperature=0.7)
    assert tv(found, target) < noise_floor(target, SAMPLES)


def test_smc_lag_bounds_the_unsettled_text_and_keeps_the_distribution():
    """With draft == target every weight stays equal, so smc never resamples and its particles, which rarely
    agree, settle little before the end. A lag of L collapses the population onto one particle whenever more
    than L tokens are unsettled: all but the last L + K + 1 tokens stream, and the collapse (a particle drawn by
    its weight) keeps the target's distribution over x0 and three cycles."""
    e = engine.Engine.of_models(TARGET, TARGET)
    options = dict(method="smc", particles=3, draft_len=2, temperature=1.0, max_new_tokens=30)
    free, bounded = (e.generate(PROMPT, lag=lag, **options).stats for lag in (0, 4))
    assert free["collapses"] == 0 and bounded["collapses"] > 0 and bounded["resamples"] == bounded["collapses"]
    assert bounded["streamed"] >= 30 - (4 + 2 + 1)
    target = exact(TARGET, 4, 1.0)
    found = empirical(e, SAMPLES, 4, method="smc", particles=3, draft_len=1, lag=1, temperature=1.0)
    assert tv(found, target) < noise_floor(target, SAMPLES)


@pytest.mark.slow
def test_smc_approaches_the_target_as_particles_grow():
    target, draft = exact(TARGET, 2 * K, 1.0), exact(DRAFT, 2 * K, 1.0)
    e = engine.Engine.of_models(TARGET, DRAFT)
    distance = {n: tv(empirical(e, 2 * SAMPLES, 2 * K, method="smc", particles=n, draft_len=K, temperature=1.0,
                                ess_threshold=1.0), target) for n in (1, 4, 16)}
    floor = noise_floor(target, 2 * SAMPLES, 0.5)
    print(f"\nTV to the target: draft alone {tv(draft, target):.3f}; smc " +
          ", ".join(f"N={n} {d:.3f}" for n, d in distance.items()) + f"; sampling noise floor {floor:.3f}")
    assert distance[1] > distance[4] > distance[16]
    assert distance[16] < 0.5 * tv(draft, target)


@pytest.mark.slow
def test_smc_with_a_power_target_approaches_p_to_the_alpha():
    """--power alpha: the population targets p ** alpha over whole sequences (normalised), sharper than p."""
    p = exact(TARGET, 2 * K, 1.0)
    target = p ** 2 / (p ** 2).sum()
    e = engine.Engine.of_models(TARGET, DRAFT)
    distance = {n: tv(empirical(e, SAMPLES, 2 * K, method="smc", particles=n, draft_len=K, temperature=1.0,
                                ess_threshold=1.0, power=2.0), target) for n in (1, 4, 16)}
    print(f"\nTV to p^2: the target itself {tv(p, target):.3f}; smc " +
          ", ".join(f"N={n} {d:.3f}" for n, d in distance.items()))
    assert distance[1] > distance[4] > distance[16]
    assert distance[16] < 0.5 * tv(p, target)
    same = dict(method="smc", particles=3, draft_len=2, max_new_tokens=12, seed=4)
    assert e.generate(PROMPT, power=1.0, **same).tokens == e.generate(PROMPT, **same).tokens


# ---------------------------------------------------------------- pitfalls and mechanics


def started(e, **options):
    """A one-slot batch with PROMPT admitted -> its Models, State and Shape (call inside torch.inference_mode)."""
    req = e.request(PROMPT, **options)
    b = scheduler.Batch(e.load().models, req.shape, 1, len(PROMPT), req.capacity)
    b.admit(req)
    return b.models, b.st, b.shape


def test_draft_and_target_caches_hold_every_particle_context():
    """After cycles with resampling at every one, each particle's suffix K/V equal a fresh prefill of its own
    tokens: the target's up to x0 (pending), the draft's up to t_K (its first draft step writes t_K and b)."""
    e = engine.Engine.of_models(TARGET, DRAFT)
    with torch.inference_mode():
        m, st, s = started(e, max_new_tokens=20, temperature=1.0, particles=4, draft_len=3, ess_threshold=1.0)
        for _ in range(3):
            decode.cycle(m, st, s)
        n = int(st.gen_len[0])
        assert int(st.tcache.suffix_len[0]) == n - 1 and int(st.dcache.suffix_len[0]) == n - 1
        assert st.resamples[0] == 3
        prev, x0 = decode.pending(st)
        for i in range(4):
            assert x0[0, i] == st.hist[0, i, n] and prev[0, i] == st.hist[0, i, n - 1]
            for net, cache, known in ((TARGET, st.tcache, n - 1), (DRAFT, st.dcache, n - 2)):
                tokens = PROMPT + st.hist[0, i, 1:1 + known].tolist()
                fresh = model.KVCache(net.config, 1, len(tokens), 1, "cpu", torch.float32)
                net.prefill(torch.tensor(tokens), fresh)
                start = len(tokens) - int(cache.suffix_len[0])
                assert torch.allclose(cache.suffix_k[:, 0, i, :, :int(cache.suffix_len[0])],
                                      fresh.prefix_k[:, 0, :, start:], atol=1e-5)


def test_tokens_after_eos_carry_no_weight():
    """EOS (0) at t_2 of a K = 4 block: t_1 and t_2 weigh, t_3 and t_4 not; later tokens become the pad (V). A
    finished particle weighs nothing."""
    eos = torch.arange(V + 1) % V == 0  # the EOS table: 0, and the pad V
    x0, t, b = torch.tensor([[5, 5]]), torch.tensor([[[4, 0, 6, 7], [4, 4, 6, 7]]]), torch.tensor([[3, 3]])
    logp, logq = torch.full((1, 2, 4), -1.0), torch.full((1, 2, 4), -2.0)
    increments, tokens = decode.smc_increments(x0, t, b, logp, logq, torch.tensor([[False, False]]), eos, V)
    assert increments.tolist() == [[2.0, 4.0]]
    assert tokens.tolist() == [[[4, 0, V, V, V], [4, 4, 6, 7, 3]]]
    increments, tokens = decode.smc_increments(x0, t, b, logp, logq, torch.tensor([[True, False]]), eos, V)
    assert increments.tolist() == [[0.0, 4.0]] and tokens[0, 0].tolist() == [V] * 5


def eos_prone(seed):
    m = tiny(seed, 0.8, eos=[0])
    with torch.no_grad():
        m.lm_head[0] += 0.3 * m.norm  # leans every hidden state towards EOS
    return m


def test_eos_inside_a_draft_block_ends_the_text():
    e = engine.Engine.of_models(eos_prone(0), eos_prone(1))
    results = [e.generate(PROMPT, method="smc", particles=4, draft_len=4, max_new_tokens=40, seed=seed,
                          temperature=1.0) for seed in range(12)]
    assert any(r.stats["stop"] == "eos" for r in results)
    for r in results:
        assert 0 not in r.tokens and len(r.tokens) == r.stats["new_tokens"]
        assert r.stats["stop"] == "eos" or len(r.tokens) == 40


def test_finished_particles_stay_and_can_be_ancestors():
    e = engine.Engine.of_models(eos_prone(0), eos_prone(1))
    with torch.inference_mode():
        m, st, s = started(e, max_new_tokens=20, temperature=1.0, particles=4, draft_len=2)
        decode.cycle(m, st, s)
        before = int(st.resamples[0])
        st.finished[0] = torch.tensor([False, True, False, False])
        st.hist[0, 1, 1:4] = torch.tensor([7, 0, V])
        st.logw[0] = torch.tensor([-50.0, 0.0, -50.0, -50.0])
        decode.resample(m, st, s)
    assert st.finished.all() and (st.hist[0, :, 1:4] == torch.tensor([7, 0, V])).all()
    assert st.logw.eq(0).all() and st.resamples[0] == before + 1


def test_same_seed_same_output_other_seeds_other_outputs():
    e = engine.Engine.of_models(TARGET, DRAFT)
    for method in ("ar", "sd", "smc"):
        runs = [e.generate(PROMPT, method=method, max_new_tokens=12, seed=seed).tokens for seed in (0, 0, 1, 2, 3)]
        assert runs[0] == runs[1]
        assert len({tuple(r) for r in runs}) > 2


def test_final_particle_by_argmax_and_statistics():
    """select="argmax" returns the particle of the largest weight after the last cycle (never resampled nor
    collapsed: the weights of the whole run); 20 tokens at K = 3 take 5 cycles; the ESS lies in [1, N]."""
    e, last = engine.Engine.of_models(TARGET, DRAFT), []
    req = e.request(PROMPT, method="smc", particles=6, draft_len=3, max_new_tokens=20, select="argmax",
                    ess_threshold=0.0, lag=0, on_cycle=lambda b, r: last.append((b.st.logw[r].tolist(),
                                                                          b.st.hist[r, :, 1:21].tolist())))
    r = engine.run(e, [req])[0]
    logw, hist = last[-1]
    st = r.stats
    assert len(set(logw)) == 6 and st["particle"] == logw.index(max(logw)) and r.tokens == hist[st["particle"]]
    assert len(r.tokens) == 20 and r.text is None
    assert st["cycles"] == len(last) == 5 and st["particles"] == 6 and 1 <= st["mean_ess"] <= 6
    assert st["resamples"] == 0 and st["tokens_per_s"] > 0


def test_top_k_one_is_greedy():
    e = engine.Engine.of_models(TARGET, DRAFT)
    greedy = e.generate(PROMPT, method="ar", temperature=0, max_new_tokens=15).tokens
    for method in ("ar", "sd"):
        assert e.generate(PROMPT, method=method, top_k=1, max_new_tokens=15).tokens == greedy


def test_top_p_and_top_k_per_request():
    """One call, three requests: top-p 0.8 keeps the nucleus, no restriction keeps every possible token, top-k 1
    keeps the argmax."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log().expand(3, 4)  # probabilities 0.5, 0.33, 0.17, 0
    kept = decode.restrict(logits, torch.ones(3), torch.tensor([0, 0, 1]), torch.tensor([0.8, 1.0, 1.0]))
    assert kept.isfinite().tolist() == [[True, True, False, False], [True, True, True, False],
                                        [True, False, False, False]]


def test_ctrl_c_returns_what_has_settled():
    def interrupt(tokens):
        if len(tokens) >= 5:
            raise KeyboardInterrupt
    e = engine.Engine.of_models(TARGET, DRAFT)
    full = e.generate(PROMPT, method="ar", max_new_tokens=20).tokens
    r = e.generate(PROMPT, method="ar", max_new_tokens=20, on_tokens=interrupt)
    assert r.stats["stop"] == "interrupted" and r.tokens == full[:5]



def test_on_tokens_can_stop_generation():
    e = engine.Engine.of_models(TARGET, DRAFT)
    full = e.generate(PROMPT, method="sd", max_new_tokens=20).tokens
    r = e.generate(PROMPT, method="sd", max_new_tokens=20, on_tokens=lambda tokens: len(tokens) >= 5)
    assert r.stats["stop"] == "stopped" and r.tokens[:5] == full[:5] and len(r.tokens) < 20


def test_default_shapes_resample():
    """smc's default N on every device can resample at the default threshold (ESS < 0.5 N is reachable, since
    ESS >= 1; N=2 never would); given values win; sd drafts 4 tokens, ar is one row."""
    def nk(method, particles=None, draft_len=None, device="cpu"):
        s = settings.Settings(method=method, particles=particles, draft_len=draft_len).resolve(device)
        return s.particles, s.draft_len
    for device, expected in (("cpu", (3, 2)), ("cuda", (4, 4))):
        n, k = nk("smc", device=device)
        assert (n, k) == expected and 0.5 * n > 1
    assert nk("smc", 5) == (5, 2) and nk("sd", 5) == (1, 4) and nk("ar", None, 3) == (1, 1)


def test_streamed_counts_what_settled_before_the_last_cycle():
    """ar and smc with one particle settle every token at once: streamed is all but the last cycle's tokens (the
    prefill's, then K + 1 a cycle). Four particles never resampled (nor collapsed: no lag) agree only where their
    independent draws do, so nearly nothing can be shown while generating; resampled at every cycle they coalesce
    (over 64 seeds: more than ten times as many tokens streamed), and never more than had been generated before the
    last cycle."""
    e = engine.Engine.of_models(TARGET, DRAFT)
    assert e.generate(PROMPT, method="ar", max_new_tokens=10).stats["streamed"] == 9
    one = e.generate(PROMPT, method="smc", particles=1, draft_len=2, max_new_tokens=30).stats
    assert one["streamed"] == 1 + 3 * (one["cycles"] - 1) == 28
    requests = [dict(prompt=PROMPT, seed=seed) for seed in range(64)]
    streamed = {threshold: [r.stats["streamed"] for r in e.generate(
        requests, slots=64, method="smc", particles=4, draft_len=2, max_new_tokens=30, ess_threshold=threshold,
        lag=0)]
        for threshold in (0.0, 1.0)}
    assert sum(streamed[1.0]) > 10 * sum(streamed[0.0]) and max(streamed[1.0]) <= 28


def test_a_population_without_weight_stops_the_run(monkeypatch):
    """From the second cycle on the target forbids every particle's draft tokens (their logits -inf, as a
    restricted target would) or its logits are NaN: the run stops ("degenerate") with only what had settled
    before, instead of resampling a weightless population uniformly and going on."""
    e = engine.Engine.of_models(TARGET, DRAFT)
    options = dict(method="smc", particles=4, draft_len=2, max_new_tokens=30, ess_threshold=1.0, seed=1)
    full = e.generate(PROMPT, **options).tokens
    verify = decode.target_logits

    def broken(m, st, s, block):
        logits = verify(m, st, s, block)  # [R, N, K+1, V]
        calls.append(1)
        if len(calls) == 1:
            return logits
        if how == "nan":
            return logits.fill_(float("nan"))
        logits[:, :, :-1].scatter_(-1, block[..., 1:, None], float("-inf"))  # the drafts t_1..t_K
        return logits
    for how in ("forbidden", "nan"):
        calls = []
        monkeypatch.setattr(decode, "target_logits", broken)
        r = e.generate(PROMPT, **options)
        assert r.stats["stop"] == "degenerate" and r.stats["cycles"] == 2
        assert r.tokens == full[:len(r.tokens)] and len(r.tokens) < 30


@pytest.mark.parametrize("method", methods.METHODS)
@pytest.mark.parametrize("budget", [1, 2])
def test_cuda_graphs_are_recorded_once_over_empty_slots(monkeypatch, method, budget):
    """The CUDA-graph path with its recording swapped for its warm-up cycle (replays run eagerly over every slot),
    so its logic runs on a CPU: the batch records once, when it is made, before any request is in it (the
    warm-up changes no request's state), a request done at its first token runs no cycle, and the output is the
    eager one."""
    recorded = []

    def record(fn):
        recorded.append(fn.func.__name__)  # the phase the partial records
        fn()
        return fn
    e = engine.Engine.of_models(TARGET, DRAFT)
    options = dict(method=method, max_new_tokens=budget, seed=2, particles=3, draft_len=3)
    eager = e.generate(PROMPT, **options)
    monkeypatch.setattr(decode, "record", record)
    monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    admit = scheduler.Batch.admit
    monkeypatch.setattr(scheduler.Batch, "admit", lambda b, req: recorded.append("admit") or admit(b, req))
    graph = e.generate(PROMPT, **options)
    assert graph.tokens == eager.tokens and len(graph.tokens) == budget and graph.stats["cycles"] == budget - 1
    assert recorded == ["cycle", "admit"]


def test_the_draft_prefill_computes_no_logits(monkeypatch):
    """The draft's prompt logits are never used: computing them cost +350 ms on a 62-token prompt and
    prompt x vocabulary floats of memory."""
    shapes, logits = [], DRAFT._logits
    monkeypatch.setattr(DRAFT, "_logits", lambda h: shapes.append(tuple(h.shape[:-1])) or logits(h))
    e = engine.Engine.of_models(TARGET, DRAFT)
    for method in ("sd", "smc"):
        e.generate(PROMPT, method=method, max_new_tokens=6, particles=2, draft_len=2)
    assert shapes and all(len(shape) == 2 for shape in shapes)  # [R, N]: draft steps only


def test_many_eos_ids_use_a_table_not_isin(monkeypatch):
    """Twelve EOS ids: torch.isin would sort them (a host sync that breaks CUDA-graph capture); the EOS table
    gives the same stops at a cost that does not depend on how many there are."""
    eos = list(range(20, 32))
    target = tiny(0, 0.8, vocab=32, eos=eos)
    e = engine.Engine.of_models(target, perturbed(target, 1, 0.3))
    monkeypatch.setattr(torch, "isin", lambda *a, **k: pytest.fail("torch.isin called"))
    for method in methods.METHODS:
        results = [e.generate(PROMPT, method=method, max_new_tokens=12, seed=seed) for seed in range(4)]
        assert any(r.stats["stop"] == "eos" for r in results)
        for r in results:
            assert not set(r.tokens) & set(eos) and (r.stats["stop"] == "eos" or len(r.tokens) == 12)


@pytest.mark.slow
def test_smc_through_the_interpreted_triton_kernels(monkeypatch):
    """At temperature 0.02 sampling is the argmax: on this path the tiny models' logit margins are at least 1.3,
    65 once tempered, more than any two Gumbel draws differ. So the Triton kernels (Philox noise) give the
    reference kernels' tokens (torch's generator) and log-normaliser (the draft's argmax is not the target's:
    every weight moves), and identical particles weigh the same: no resampling even at threshold 1."""
    options = dict(method="smc", particles=4, draft_len=2, max_new_tokens=6, temperature=0.02, ess_threshold=1.0)
    reference = engine.Engine.of_models(TARGET, DRAFT).generate(PROMPT, **options)
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    triton = engine.Engine.of_models(TARGET, DRAFT).generate(PROMPT, **options)
    assert triton.tokens == reference.tokens and len(triton.tokens) == 6
    assert triton.stats["resamples"] == reference.stats["resamples"] == 0 and triton.stats["mean_ess"] == 4
    assert triton.stats["log_z"] == pytest.approx(reference.stats["log_z"], rel=1e-5) and triton.stats["log_z"] < -1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log2(0) = -inf for an empty slot
@pytest.mark.parametrize("method", methods.METHODS)
def test_batching_through_the_interpreted_triton_kernels(monkeypatch, method):
    """The GPU's kernels (sampling keyed per request, attention over slots of different lengths, empty ones
    included, resampling and gather per request) under the interpreter: each request decodes alone as in a batch
    of two slots shared by three requests."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    target = tiny(0, 0.8, vocab=16, head_dim=16)
    e = engine.Engine.of_models(target, perturbed(target, 1, 0.3))
    requests = [dict(prompt=[1, 2, 3], seed=1, max_new_tokens=6), dict(prompt=[4], seed=2, max_new_tokens=3),
                dict(prompt=[5, 6], seed=1, max_new_tokens=5)]
    options = dict(method=method, particles=2, draft_len=2, ess_threshold=1.0, temperature=1.0)
    together = forked(lambda: [r.tokens for r in e.generate(requests, slots=2, **options)])
    assert [e.generate(**(options | r)).tokens for r in requests] == together()


@pytest.mark.slow
def test_racer_trees_through_the_interpreted_triton_kernels(monkeypatch):
    """The tree mask through the Triton attention kernel (interpreted) inside whole racer runs: greedy tokens
    equal to the reference kernels', and a request decodes alone as in a batch."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    e = engine.Engine.of_models(tiny(0, 0.8, vocab=16, head_dim=16), "racer")
    requests = [dict(prompt=[1, 2, 3, 1, 2], seed=0, max_new_tokens=8), dict(prompt=[4, 5], seed=1, max_new_tokens=6),
                dict(prompt=[6, 1], seed=2, max_new_tokens=7)]
    options = dict(method="sd", tree=5, draft_len=2, temperature=1.0)
    together = forked(lambda: [r.tokens for r in e.generate(requests, slots=2, **options)])
    assert [e.generate(**(options | r)).tokens for r in requests] == together()
    triton = [e.generate(**(options | r | {"temperature": 0})).tokens for r in requests]
    monkeypatch.setattr(kernels, "INTERPRET", False)
    assert [e.generate(**(options | r | {"temperature": 0})).tokens for r in requests] == triton


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_output():
    target = tiny(0, 0.8, vocab=64, head_dim=16, device="cuda")  # tl.dot wants dimensions of 16 or more
    e = engine.Engine.of_models(target, perturbed(target, 1, 0.3))
    for method in ("ar", "sd", "smc"):
        graph, eager = (e.generate(PROMPT, method=method, max_new_tokens=30, seed=3, cuda_graphs=graphs)
                        for graphs in (True, False))
        assert graph.tokens == eager.tokens and graph.stats["cycles"] == eager.stats["cycles"]
    racer = engine.Engine.of_models(target, "racer")  # tree drafts: the tree tensors planted before each replay
    graph, eager = (racer.generate(PROMPT, method="sd", tree=6, draft_len=3, max_new_tokens=30, seed=3,
                                   cuda_graphs=graphs) for graphs in (True, False))
    assert graph.tokens == eager.tokens
    requests = [dict(prompt=PROMPT, seed=seed, max_new_tokens=20) for seed in range(5)]
    for method in ("sd", "smc"):  # MineDraft's halves on two CUDA streams
        plain, overlap = (e.generate(requests, method=method, slots=4, overlap=o) for o in (False, True))
        assert [r.tokens for r in overlap] == [r.tokens for r in plain]


# ---------------------------------------------------------------- batching


def mixed_requests(method):
    """Four requests of different prompt lengths, seeds and budgets; for ar and sd also a greedy one and one
    with top-p (so the batch's cycles restrict the target's logits, which must not touch the others)."""
    requests = [dict(prompt=[1, 2, 3], seed=0, max_new_tokens=12), dict(prompt=[4, 5], seed=1, max_new_tokens=7),
                dict(prompt=[6, 1, 2, 3, 4], seed=0, max_new_tokens=15), dict(prompt=[2], seed=3, max_new_tokens=9)]
    if method != "smc":
        requests[1]["temperature"], requests[2]["top_p"] = 0, 0.9
    return requests


@pytest.mark.parametrize("method", methods.METHODS)
def test_a_request_decodes_the_same_alone_and_in_any_batch(method):
    """Each request's randomness is its own (seed and counter per slot) and its lengths are its own, so its
    output does not depend on its neighbours: alone, four at once, and two slots shared by four requests that
    join as others end (EOS ends some early)."""
    e = engine.Engine.of_models(eos_prone(0), eos_prone(1))
    options = dict(method=method, particles=3, draft_len=2, temperature=1.0)
    requests = mixed_requests(method)
    requests[0]["seed"] = next(seed for seed in range(100)  # one request that ends at an EOS
                               if e.generate(**(options | requests[0] | {"seed": seed})).stats["stop"] == "eos")
    alone = [e.generate(**(options | r)) for r in requests]
    assert "eos" in {r.stats["stop"] for r in alone}
    for slots in (4, 2):
        together = e.generate(requests, slots=slots, **options)
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        assert [r.stats["stop"] for r in together] == [r.stats["stop"] for r in alone]


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: w4a8 falls back to int4")
@pytest.mark.parametrize("method", methods.METHODS)
def test_w4a8_decodes_a_request_the_same_alone_and_in_any_batch(method):
    """w4a8 rounds each activation row on its own (per superblock of 256), so its batches keep every request's
    tokens."""
    e = engine.Engine.of_models(in_format(WIDE, "w4a8"), in_format(perturbed(WIDE, 3, 0.3), "w4a8"))
    options = dict(method=method, particles=3, draft_len=2, temperature=1.0)
    requests = mixed_requests(method)
    alone = [e.generate(**(options | r)).tokens for r in requests]
    for slots in (4, 2):
        assert [r.tokens for r in e.generate(requests, slots=slots, **options)] == alone


@pytest.mark.parametrize("method", methods.METHODS)
def test_the_graph_path_runs_every_slot_and_gives_the_eager_output(monkeypatch, method):
    """On a CUDA graph the cycle runs over all slots, empty ones included (recording swapped for the warm-up
    cycle, so this runs on a CPU): empty slots append nothing and disturb no one; one recording per batch."""
    e = engine.Engine.of_models(eos_prone(0), eos_prone(1))
    options = dict(method=method, particles=3, draft_len=2, temperature=1.0, slots=3)
    eager = e.generate(mixed_requests(method), **options)
    recordings = []
    monkeypatch.setattr(decode, "record", lambda fn: recordings.append(1) or fn() or fn)
    monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    graph = e.generate(mixed_requests(method), **options)
    assert [r.tokens for r in graph] == [r.tokens for r in eager]
    assert len(recordings) == (1 if method == "smc" else 2)  # one batch with top-p requests, one without


@pytest.mark.parametrize("method", ["sd", "smc"])
def test_overlap_gives_each_request_its_tokens_without_overlap(monkeypatch, method):
    """MineDraft: two half-batches take turns (one drafts while the other verifies, on two threads), each
    request decoding as alone; a half is refilled between its verify and its next draft."""
    e = engine.Engine.of_models(eos_prone(0), eos_prone(1))
    options = dict(method=method, particles=3, draft_len=2, temperature=1.0)
    requests = [r | {"top_p": 1.0} for r in mixed_requests(method)] + [dict(prompt=[3, 3], seed=5, max_new_tokens=10)]
    alone = [e.generate(**(options | r)) for r in requests]  # one shape: top-p would make a batch of its own
    rounds, run = [], scheduler.Batch.run_phase
    phases = {"draft_block": "draft", "verify_cycle": "verify"}

    def traced(batch, fn):
        rounds.append((threading.get_ident(), id(batch), phases[fn.__name__]))
        return run(batch, fn)
    monkeypatch.setattr(scheduler.Batch, "run_phase", traced)
    together = e.generate(requests, slots=4, overlap=True, **options)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    halves = sorted({b for _, b, _ in rounds})
    assert len(halves) == 2 and all(p in ("draft", "verify") for _, _, p in rounds)
    for b in halves:  # each half alternates draft, verify
        assert [p for _, x, p in rounds if x == b] == ["draft", "verify"] * (len([x for _, x, _ in rounds
                                                                                 if x == b]) // 2)
    assert len({t for t, _, _ in rounds}) == 2  # on the pool's two threads
    with pytest.raises(errors.UsageError, match="at least 2 slots"):
        e.generate(requests[:1] * 2, slots=1, overlap=True, **options)
    with pytest.raises(errors.UsageError, match="overlap runs a draft model"):
        e.generate(PROMPT, method="ar", overlap=True)


def test_requests_of_different_shapes_share_a_call():
    """Different methods (or N, K) make different batches, which take turns; each output is the one alone."""
    e = engine.Engine.of_models(TARGET, DRAFT)
    requests = [dict(prompt=PROMPT, method=m, seed=3, max_new_tokens=8) for m in methods.METHODS]
    requests.append(dict(prompt=PROMPT, method="smc", particles=2, seed=3, max_new_tokens=8))
    alone = [e.generate(**r).tokens for r in requests]
    assert [r.tokens for r in e.generate(requests)] == alone


def test_empty_slots_run_no_rows_on_a_cpu(monkeypatch):
    """An eager cycle runs only the slots up to the last busy one: one request in a batch of four costs one."""
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    rows, step = [], TARGET.step
    monkeypatch.setattr(TARGET, "step", lambda tokens, *a, **k: rows.append(tokens.shape[0]) or step(tokens, *a, **k))
    requests = [e.request(PROMPT, method="sd", max_new_tokens=n) for n in (12, 3)]
    engine.run(e, requests, slots=4)
    assert max(rows) == 2 and rows[-1] == 1  # the short request left, the long one went on alone


def test_a_cancelled_request_frees_its_slot():
    e = engine.Engine.of_models(TARGET, DRAFT)
    first = e.request(PROMPT, method="ar", max_new_tokens=30, on_tokens=lambda t: len(t) >= 4 and first.cancel())
    second = e.request(PROMPT, method="ar", max_new_tokens=10, seed=4)
    engine.run(e, [first, second], slots=1)
    assert first.result.stats["stop"] == "cancelled" and 4 <= len(first.result.tokens) < 30
    assert second.result.tokens == e.generate(PROMPT, method="ar", max_new_tokens=10, seed=4).tokens


def test_serve_takes_requests_from_a_queue_until_none():
    import queue
    import threading
    e = engine.Engine.of_models(TARGET, DRAFT)
    inbox, done = queue.Queue(), []
    worker = threading.Thread(target=e.serve, args=(inbox, 2))
    worker.start()
    for seed in range(3):
        inbox.put(e.request(PROMPT, method="smc", seed=seed, max_new_tokens=6, on_done=done.append))
    for _ in range(600):
        if len(done) == 3:
            break
        threading.Event().wait(0.05)
    inbox.put(None)
    worker.join(30)
    assert not worker.is_alive() and len(done) == 3 and all(len(r.tokens) == 6 for r in done)


def test_a_failing_batch_ends_its_requests_and_serving_goes_on(monkeypatch):
    import queue
    e = engine.Engine.of_models(TARGET, DRAFT)
    verify, calls = decode.target_logits, []

    def failing(m, st, s, block):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of\nmemory")
        return verify(m, st, s, block)
    monkeypatch.setattr(decode, "target_logits", failing)
    inbox, done = queue.Queue(), []
    first = e.request(PROMPT, method="smc", max_new_tokens=20, on_done=done.append)
    second = e.request(PROMPT, method="smc", max_new_tokens=20, seed=1, on_done=done.append)
    inbox.put(first)
    for item in engine.serving(e, inbox, 1, (32, 32)):
        if len(done) == 1:
            inbox.put(second)
        if len(done) == 2:
            break
    assert first.result.stats["stop"] == "error" and first.result.stats["error"] == "out of memory"
    assert second.result.stats["stop"] == "length" and len(second.result.tokens) == 20
    with pytest.raises(RuntimeError):  # the API (until_idle) raises instead
        calls.clear()
        e.generate(PROMPT, method="smc", max_new_tokens=20)


def test_a_failed_device_ends_everything_and_says_why(monkeypatch):
    """A failure after which the device runs nothing (a CUDA error is sticky) ends every request, running and
    waiting, with its reason, and serving stops with DeviceFailed; engine.failure says why (the server's 503)."""
    import queue
    e = engine.Engine.of_models(TARGET, DRAFT)
    monkeypatch.setattr(decode, "target_logits",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("device-side assert")))
    monkeypatch.setattr(e, "device_ok", lambda: False)
    inbox, done = queue.Queue(), []
    for seed in range(3):
        inbox.put(e.request(PROMPT, method="smc", max_new_tokens=20, seed=seed, on_done=done.append))
    with pytest.raises(errors.DeviceFailed, match="device-side assert"):
        e.serve(inbox, slots=2, context=(8, 32))
    assert [r.stats["stop"] for r in done] == ["error"] * 3 and [r.stats["error"] for r in done] == \
        ["device-side assert"] * 2 + ["the device failed and can run nothing more: device-side assert"]  # each its own
    assert "the device failed" in e.failure


def test_a_failing_admit_leaves_its_slot_empty(monkeypatch):
    """A prefill that fails after writing the slot's prefix length leaves the slot as it was: empty."""
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    prefill = TARGET.prefill

    def half_done(tokens, cache, r=0, **k):
        prefill(tokens, cache, r, **k)
        raise RuntimeError("no memory")
    with torch.inference_mode():
        req = e.request(PROMPT, method="smc", max_new_tokens=10)
        b = scheduler.Batch(e.models, req.shape, 2, 8, req.capacity)
        monkeypatch.setattr(TARGET, "prefill", half_done)
        with pytest.raises(RuntimeError, match="no memory"):
            b.admit(req)
        assert b.requests == [None, None] and b.st.tcache.prefix_len.tolist() == [0, 0] and not b.st.live.any()


def test_one_dict_prompt_is_one_request():
    e = engine.Engine.of_models(TARGET, DRAFT)
    r = e.generate({"prompt": PROMPT, "seed": 3, "max_new_tokens": 7}, method="sd")
    assert r.tokens == e.generate(PROMPT, method="sd", seed=3, max_new_tokens=7).tokens


def test_without_eos_ids_the_pad_is_no_token(tmp_path):
    """With no EOS id the pad lies past the vocabulary: smc particles ended by a stop string append it, and it
    shows up in no result's tokens or counts."""
    e = engine.Engine(save(TARGET, str(tmp_path / "t")), save(DRAFT, str(tmp_path / "d")), weights="float32")
    assert not e.config.eos_ids
    for seed in range(4):
        r = e.generate("w1 w2 w3", method="smc", particles=4, draft_len=2, max_new_tokens=30, seed=seed,
                       temperature=1.0, ess_threshold=0.0, stop=["w6"])
        assert all(0 <= t < V for t in r.tokens) and r.stats["new_tokens"] == len(r.tokens)
        assert r.stats["stop"] in ("stop", "length")


def test_memory_counts_what_torch_caches_and_a_slot_that_exists(monkeypatch):
    """Free CUDA memory includes what torch has cached but does not use; a request that joins a batch that
    exists needs no new memory, however little is free."""
    import queue
    with monkeypatch.context() as m:  # not monkeypatch.undo(): that would undo the reference kernels' fixture too
        m.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 30, 80 << 30))
        m.setattr(torch.cuda, "memory_reserved", lambda device: 5 << 30)
        m.setattr(torch.cuda, "memory_allocated", lambda device: 2 << 30)
        assert scheduler.free_bytes(torch.device("cuda")) == 4 << 30
    e = engine.Engine.of_models(TARGET, DRAFT)
    inbox, done = queue.Queue(), []
    inbox.put(e.request(PROMPT, method="sd", max_new_tokens=6, on_done=done.append))
    loop = engine.serving(e, inbox, 2, (8, 16))
    while not done:
        next(loop)
    monkeypatch.setattr(scheduler, "free_bytes", lambda device: 0)
    late, other = (e.request(PROMPT, method=m, max_new_tokens=6, seed=1, on_done=done.append) for m in ("sd", "smc"))
    inbox.put(late)
    inbox.put(other)
    while len(done) < 3:
        next(loop)
    assert late.result.stats["stop"] == "length"  # its batch exists
    assert other.result.stats["stop"] == "refused" and "GiB" in other.result.stats["error"]  # a new batch: refused


def test_idle_batches_are_dropped():
    """A batch with no request for idle_s is dropped: a long-running server keeps no cache per shape seen."""
    import queue
    e = engine.Engine.of_models(TARGET, DRAFT)
    inbox, done, batches = queue.Queue(), [], []
    sched = scheduler.Scheduler(e.load(), 2, (8, 32), False, idle_s=0.0)
    for method in ("sd", "smc", "ar"):
        inbox.put(e.request(PROMPT, method=method, max_new_tokens=6, on_done=done.append))
        with torch.inference_mode():
            for _ in sched.rounds(inbox, True):
                batches.append({s.method for s in sched.batches})
    assert len(done) == 3 and all(r.stats["stop"] == "length" for r in done)
    assert all(len(b) <= 1 for b in batches) and not sched.batches


def test_smc_particles_end_at_a_stop_string(tmp_path):
    """Without resampling (nor a lag) smc's particles rarely agree, so little settles: the request ends after the first
    cycle after which every particle's text holds the stop string (each then ends there, as at an EOS; the others'
    draws are those of the run without it), while the text they share does not, long before its budget."""
    e = engine.Engine(save(TARGET, str(tmp_path / "t")), save(DRAFT, str(tmp_path / "d")), weights="float32")
    options = dict(method="smc", particles=4, draft_len=2, max_new_tokens=45, temperature=1.0, ess_threshold=0.0,
                   lag=0)
    for seed in range(3):
        texts = []  # after each cycle of the run without a stop string, every particle's text

        def record(b, r):
            texts.append([e.tokenizer.decode(t) for t in b.st.hist[r, :, 1:1 + int(b.st.gen_len[r])].tolist()])
        full = engine.run(e, [e.request("w1 w2 w3", seed=seed, on_cycle=record, **options)])[0]
        assert full.stats["cycles"] == len(texts) == 15  # 1 + 3 * 15 >= 45 tokens
        first = next(c for c, cycle in enumerate(texts, 1) if all("w6" in text for text in cycle))
        assert "w6" not in os.path.commonprefix(texts[first - 1])
        r = e.generate("w1 w2 w3", seed=seed, stop=["w6"], **options)
        assert r.stats["stop"] == "stop" and r.stats["cycles"] == first < 15 and "w6" not in r.text


def test_a_request_larger_than_a_slot_is_refused():
    import queue
    e = engine.Engine.of_models(TARGET, DRAFT)
    inbox, done = queue.Queue(), []
    big, small = (e.request(PROMPT, method="ar", max_new_tokens=n, on_done=done.append) for n in (30, 10))
    inbox.put(big)
    inbox.put(small)
    for _ in engine.serving(e, inbox, 1, (16, 16), False):
        if len(done) == 2:
            break
    assert big.result.stats["stop"] == "refused" and "a slot holds 16 + 16" in big.result.stats["error"]
    assert small.result.stats["stop"] == "length"


def test_a_failing_prefill_ends_its_request_and_serving_goes_on(monkeypatch):
    import queue
    e = engine.Engine.of_models(TARGET, DRAFT).load()
    prefill, done = TARGET.prefill, []
    monkeypatch.setattr(TARGET, "prefill", lambda tokens, *a, **k: (_ for _ in ()).throw(RuntimeError("no memory"))
                        if len(tokens) == 5 else prefill(tokens, *a, **k))
    inbox = queue.Queue()
    bad, good = (e.request(p, method="ar", max_new_tokens=5, on_done=done.append) for p in ([1] * 5, PROMPT))
    inbox.put(bad)
    inbox.put(good)
    for _ in engine.serving(e, inbox, 1, (16, 16), False):
        if len(done) == 2:
            break
    assert bad.result.stats == bad.result.stats | {"stop": "error", "error": "no memory"}
    assert good.result.stats["stop"] == "length"


@pytest.mark.parametrize("method", methods.METHODS)
def test_stop_strings_and_the_text_stream(tmp_path, method):
    """The stream's pieces add up to the result's text; a stop string ends the text before it (and may not
    appear in any piece shown before it was complete), with the same text up to there as without it."""
    e = engine.Engine(save(TARGET, str(tmp_path / "t")), save(DRAFT, str(tmp_path / "d")), weights="float32")
    options = dict(method=method, max_new_tokens=30, temperature=1.0, seed=2)
    full = e.generate("w1 w2 w3", **options)
    words = full.text.split()
    stop = " ".join(words[3:5])
    for stops in ([], [stop, "never"]):
        pieces, results = [], []
        for i, piece, result in e.stream(["w1 w2 w3"], stop=stops, **options):
            pieces.append(piece)
            results += [result] if result else []
        text = full.text[:full.text.find(stop)] if stops else full.text
        assert "".join(pieces) == results[0].text == text
        assert results[0].stats["stop"] == ("stop" if stops else full.stats["stop"])


# ---------------------------------------------------------------- traces


def traced(e, tmp_path, **options):
    """-> (Result, the trace's start, cycles, end) of a request run with a Tracer."""
    import plot
    req = e.request(PROMPT, **options)
    tracer = plot.Tracer(str(tmp_path / "trace.jsonl"), e, req)
    req.on_cycle, req.on_done = tracer.cycle, tracer.done
    with e.watching(tracer.phase):
        result = engine.run(e, [req])[0]
    return (result, *plot.read_trace(str(tmp_path / "trace.jsonl")))


def calls_of(monkeypatch, names):
    """-> the list each call of decode's functions `names` appends its name to, as it runs them."""
    calls = []

    def logged(name, fn):
        @functools.wraps(fn)  # its name, which observers hear
        def call(*args, **keywords):
            calls.append(name)
            return fn(*args, **keywords)
        return call
    for name in names:
        monkeypatch.setattr(decode, name, logged(name, getattr(decode, name)))
    return calls


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
@pytest.mark.parametrize("graphs", [False, True])
def test_an_observer_runs_the_same_cycle_functions(monkeypatch, tmp_path, method, graphs):
    """One path: a traced run and one timed by bench.py's observer call decode's functions, in the same order, as
    a plain run, eagerly and on the CUDA-graph path (its recording swapped for its warm-up, as a CPU can run it),
    and give its tokens; the observers hear every phase."""
    from benches import common
    if graphs:
        monkeypatch.setattr(decode, "record", lambda fn: fn() or fn)
        monkeypatch.setattr(decode, "graphs", lambda shape, device: True)
    names = ["cycle", "draft_block", "verify_cycle", "ar_cycle", "sd_cycle", "smc_cycle", "prefill_slot",
             "prefill_draft", "publish"]
    calls = calls_of(monkeypatch, names)
    options = dict(method=method, particles=3, draft_len=2, max_new_tokens=12, temperature=1.0, seed=3)
    e = engine.Engine.of_models(TARGET, DRAFT)
    plain = e.generate(PROMPT, **options)
    plain_calls = list(calls)
    calls.clear()
    result, _, cycles, _ = traced(e, tmp_path, **options)
    assert result.tokens == plain.tokens and calls == plain_calls
    calls.clear()
    with common.phase_times(e) as spent:
        timed = e.generate(PROMPT, **options)
    assert timed.tokens == plain.tokens and calls == plain_calls
    cycle_phases = {"draft_block", "verify_cycle"}
    if method == "ar":
        cycle_phases = {"verify_cycle"}
    heard = set(cycle_phases)
    if graphs:
        cycle_phases = {"cycle"}
        heard = {"cycle", "record"}
    assert set(spent) == heard
    assert all(len(spent[p]) == result.stats["cycles"] for p in cycle_phases) and all("ms" in c for c in cycles)


def test_a_trace_changes_nothing_and_agrees_with_the_statistics(tmp_path):
    """The same seed gives the same tokens traced or not; the trace's resamplings, log-normaliser, returned
    particle and ancestors reproduce the run's statistics and its tokens."""
    options = dict(method="smc", particles=4, draft_len=2, max_new_tokens=30, temperature=1.0, ess_threshold=0.9,
                   seed=5)
    plain = engine.Engine.of_models(TARGET, DRAFT).generate(PROMPT, **options)
    result, start, cycles, end = traced(engine.Engine.of_models(TARGET, DRAFT), tmp_path, **options)
    stats = result.stats
    assert result.tokens == plain.tokens and end["tokens"] == result.tokens and end["stats"] == stats
    assert start["particles"] == 4 and len(cycles) == stats["cycles"]
    assert not os.path.exists(tmp_path / "trace.jsonl.tmp")
    assert sum(c["resampled"] for c in cycles) == stats["resamples"] >= 2
    mean = lambda logw: torch.tensor(logw).logsumexp(0).item() - math.log(4)  # noqa: E731
    log_z = sum(mean(c["logw_before"]) for c in cycles if c["resampled"]) + mean(cycles[-1]["logw_after"])
    assert log_z == pytest.approx(stats["log_z"], abs=1e-3)
    i, blocks = stats["particle"], []
    for c in reversed(cycles):  # the returned particle's line: whose block it holds, cycle by cycle
        i = c["ancestors"][i]
        blocks.append(c["tokens"][i])
    lineage = result.tokens[:1] + [t for block in reversed(blocks) for t in block]  # the first: from the prefill
    assert lineage[:len(result.tokens)] == result.tokens
    assert all(c["ms"]["cycle"] >= c["ms"]["draft"] + c["ms"]["verify"] for c in cycles)


def test_an_sd_trace_holds_drafted_and_accepted_tokens(tmp_path):
    e = engine.Engine.of_models(TARGET, DRAFT)
    result, _, cycles, _ = traced(e, tmp_path, method="sd", max_new_tokens=20, seed=1)
    assert sum(c["accepted"] for c in cycles) == result.stats["accepted"]
    for c in cycles:
        assert c["tokens"][0][:c["accepted"]] == c["drafted"][:c["accepted"]] and len(c["drafted"]) == 4


def test_a_racer_trace_holds_the_tree_and_the_path_taken(tmp_path, random_trees):
    e = engine.Engine.of_models(TARGET, "racer")
    result, _, cycles, _ = traced(e, tmp_path, method="sd", max_new_tokens=20, seed=1,
                                  draft_len=3, tree=8)
    assert sum(c["accepted"] for c in cycles) == result.stats["accepted"] > 0
    for c in cycles:
        node = 0
        for token in c["tokens"][0][:c["accepted"]]:  # each accepted token is a child of the node before
            node = next(j + 1 for j, (t, p) in enumerate(zip(c["tree"], c["parents"])) if t == token and p == node)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("options, message", [
    (dict(temperature=0), "smc needs temperatures > 0.*--method sd or --method ar"),
    (dict(particles=0), "particles must be at least 1"),
    (dict(draft_len=0), "draft-len must be at least 1"),
    (dict(ess_threshold=1.5), r"ess-threshold must lie in \[0, 1\]"),
    (dict(max_new_tokens=100), "max-new-tokens 100 does not fit the context of 64 .* at most 59"),
    (dict(particles=10 ** 9, max_new_tokens=8), "KV caches and logits need .* GiB but only"),
    (dict(method="sd", top_k=V + 1), rf"top-k must lie in \[0, {V}\] \(the vocabulary\), got {V + 1}"),
    (dict(method="easd", easd=(1.0, V + 1, 0.5)), rf"easd takes .*TOP in \[1, {V}\]"),
    (dict(seed=2 ** 63), r"seed must lie in \[0, 2\*\*63\)"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(draft_len=61), "draft-len 61 does not fit the context of 64 after a 3-token prompt; use at most 60"),
    (dict(colour="red"), "unexpected keyword argument 'colour'"),
    (dict(method="beam"), "unknown method"),
    (dict(top_k=1), "smc cannot honour top-k/top-p.*--method sd or --method ar"),
    (dict(top_p=0.9), "smc cannot honour top-k/top-p.*--method sd or --method ar"),
    (dict(power=0), "power must be > 0"),
    (dict(method="sd", power=2), r"power is smc's alone \(sd samples the target itself\), got 2: drop --power"),
    (dict(method="ar", power=0.5), r"power is smc's alone \(ar samples the target itself\), got 0.5: drop --power"),
])
def test_bad_requests_are_one_line_errors(options, message):
    with pytest.raises(errors.UsageError, match=message):
        engine.Engine.of_models(TARGET, DRAFT).generate(PROMPT, **options)


def test_bad_prompts_and_models():
    e = engine.Engine.of_models(TARGET, DRAFT)
    with pytest.raises(errors.UsageError, match="the prompt is 64 tokens, longer than the context of 64"):
        e.generate([1] * 64)
    with pytest.raises(errors.UsageError, match="the prompt is empty"):
        e.generate([])
    with pytest.raises(errors.UsageError, match="no tokenizer"):
        e.generate("hello")
    with pytest.raises(errors.UsageError, match="needs a draft model"):
        engine.Engine.of_models(TARGET).generate(PROMPT, method="sd")


def test_chat_template():
    tok = loading.Tokenizer(None, "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert engine.apply_chat(tok, "hi") == "<user>hi\n<assistant>"
    assert engine.apply_chat(loading.Tokenizer(None), "hi") == "hi"


# ---------------------------------------------------------------- command line


def save(m, path):
    """A Hugging Face directory for m (an unpacked model): config.json, model.safetensors (q/k/v biases, q/k head norms
    and a separate head where m has them), a word-level tokenizer over words w0, w1, ... -> the path, a str."""
    from safetensors.torch import save_file
    from test_model import fetch_module
    c, path = m.config, str(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fetch_module().hf_config(c), f)
    tensors = {"model.embed_tokens.weight": m.embed, "model.norm.weight": m.norm}
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = m.lm_head
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i, b in enumerate(m.layers):
        p = f"model.layers.{i}."
        tensors |= dict(zip([p + f"self_attn.{x}_proj.weight" for x in "qkv"], b.wqkv.split([q, kv, kv])))
        if c.qkv_bias:
            tensors |= dict(zip([p + f"self_attn.{x}_proj.bias" for x in "qkv"], b.bqkv.split([q, kv, kv])))
        if c.qk_norm:
            tensors |= dict(zip([p + f"self_attn.{x}_norm.weight" for x in "qk"], b.qk_norm.chunk(2)))
        tensors |= dict(zip([p + f"mlp.{x}_proj.weight" for x in ("gate", "up")], b.w13.chunk(2)))
        tensors |= {p + "self_attn.o_proj.weight": b.wo, p + "mlp.down_proj.weight": b.w2,
                    p + "input_layernorm.weight": b.attn_norm, p + "post_attention_layernorm.weight": b.ffn_norm}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return words(path, c.vocab_size)


def words(path, n, changed=None):
    """path's tokenizer.json: words w0 .. w(n-1), id `changed` spelled otherwise -> path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(n)}
    if changed is not None:
        vocab = {("other" if i == changed else w): i for w, i in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return save(eos_prone(0), str(root / "target")), save(eos_prone(1), str(root / "draft"))


def run_cli(*runs):
    """engine.py in a subprocess per list of arguments, all at once (each is mostly a second or two of imports, on
    one core) -> [CompletedProcess], on the reference kernels as in this file (conftest.py set TRITON_INTERPRET),
    in bf16 unless the arguments say: --weights auto times the formats, which processes running at once disturb."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = [args if "--weights" in args else [*args, "--weights", "bf16"] for args in runs]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "engine.py"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for args in runs]
    outputs = [p.communicate() for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]


@pytest.mark.slow
def test_cli_json(pair):
    target, draft = pair
    run, = run_cli(["--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--json", "--max-new-tokens", "12"])
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert set(out) == {"text", "tokens", "stats"} and out["stats"]["method"] == "smc"
    assert out["stats"]["particles"] == 3 and out["stats"]["draft_len"] == 2  # the defaults on a CPU
    assert out["text"] == " ".join(f"w{t}" for t in out["tokens"])
    api = engine.Engine(target, draft).generate("w1 w2 w3", max_new_tokens=12)  # the API, from the same paths
    assert api.tokens == out["tokens"] and api.text == out["text"]


@pytest.mark.slow
def test_cli_jsonl_gives_one_result_per_line(pair, tmp_path):
    target, draft = pair
    lines = [{"prompt": "w1 w2 w3"}, {"prompt": "w4", "max_new_tokens": 5, "seed": 7}, {"prompt": "w5 w6"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w1"}\n{"prompt": \n')
    (tmp_path / "colour.jsonl").write_text('{"prompt": "w1", "colour": 3}\n')
    run, bad, colour = run_cli(["--target", target, "--draft", draft, "--prompt-file", str(tmp_path / "p.jsonl"),
                            "--slots", "2", "--max-new-tokens", "9"],
                           *(["--target", target, "--draft", draft, "--prompt-file", str(tmp_path / name)]
                             for name in ("bad.jsonl", "colour.jsonl")))
    assert run.returncode == 0, run.stderr
    out = [json.loads(line) for line in run.stdout.splitlines()]
    e = engine.Engine(target, draft)
    assert [o["tokens"] for o in out] == [e.generate(**({"max_new_tokens": 9} | line)).tokens for line in lines]
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: ") and "bad.jsonl:2: not JSON" in bad.stderr
    assert colour.returncode == 1 and "prompt 1: got an unexpected keyword argument 'colour'" in colour.stderr


@pytest.mark.slow
def test_cli_trace(pair, tmp_path):
    target, draft = pair
    path = str(tmp_path / "run.jsonl")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w1"}\n')
    run, batch = run_cli(["--target", target, "--draft", draft, "--prompt", "w1 w2", "--json", "--trace", path,
                          "--seed", "3", "--max-new-tokens", "12"],
                         ["--target", target, "--draft", draft, "--prompt-file", str(tmp_path / "p.jsonl"), "--trace",
                          str(tmp_path / "batch.jsonl")])
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in open(path)]
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "end" and len(lines) == lines[-1]["stats"]["cycles"] + 2
    assert lines[-1]["tokens"] == json.loads(run.stdout)["tokens"]
    assert all(line["ms"]["cycle"] > 0 for line in lines[1:-1])  # timed: the CLI's cycles are decode.py's
    assert batch.returncode == 1 and "--trace follows one prompt" in batch.stderr
    assert not os.path.exists(tmp_path / "batch.jsonl")


@pytest.mark.slow
def test_cli_streams_text_then_a_summary(pair):
    target, draft = pair
    run, = run_cli(["--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--method", "sd", "--max-new-tokens",
                "9", "--weights", "auto"])
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith("note: ")]  # a note may say ar is faster
    measuring, length, chose, loading, kept, draft_kept, summary = lines  # auto's measuring and choices, a line each
    assert kept.startswith("weights kept in ") and draft_kept.endswith("the next start reads it back")
    assert measuring.startswith("weights auto: measuring the weight formats on this CPU (once; kept in ")
    assert re.fullmatch(rf"loading {target} \([\d.]+ MB\) and the draft {draft} \([\d.]+ MB\) \.\.\.", loading)
    assert re.fullmatch(r"sd shape: K=4 \(measured ms per token, a cycle's matmuls in its cheapest formats, 0.7 of "
                        r"draft tokens accepted: K=2 \d+, K=3 \d+, K=4 \d+, K=5 \d+, K=6 \d+\)", length)
    assert re.fullmatch(r"weights: (bf16|float32|int8), draft (bf16|float32|int8) \(measured ms per sd cycle at 5 "
                        r"rows: bf16 \d+, float32 \d+, int8 \d+; its 4 draft steps at 1 rows: bf16 \d+, float32 \d+, "
                        r"int8 \d+\)", chose)  # int4 needs larger shapes
    assert run.stdout.startswith("w1 w2 w3") and summary.startswith("[sd: ")


@pytest.mark.slow
def test_auto_measures_smcs_shape_once_and_keeps_3x2_without_a_clear_win(pair, monkeypatch, capsys):
    """Under weights auto, smc's default (N, K) is measured before its first requests (engine.choose_shapes, from
    prepared requests and generate; a bare request measures nothing): the bench grid's cell whose cycle costs least
    per token, if clearly (a fifth and 5 ms: not on these tiny models), else 3 x 2; given N or K stay."""
    e = engine.Engine(*pair, weights="auto", on_line=engine.say)
    assert e.request("w1 w2", max_new_tokens=8).shape.particles == 3 and not capsys.readouterr().err  # no measuring
    first, again = requests_of(e, ["w1 w2", {"prompt": "w3", "draft_len": 3}], max_new_tokens=8)
    chose = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: ")]
    assert len(chose) == 2 and re.fullmatch(r"smc shape: 3x2 \(measured ms per token, a cycle's matmuls in its "
                                             r"cheapest formats: 3x2 \d+, 3x4 \d+, 4x2 \d+, 4x4 \d+\)", chose[1])
    assert (first.shape.particles, first.shape.draft_len, again.shape.particles, again.shape.draft_len) == (3, 2, 3, 3)
    loaded = engine.Engine(*pair, weights="auto")  # as if auto had loaded int4, which these shapes cannot pack
    assert loaded.measurement.choose_shape(methods.SMC, "int4", "int4")[0] == (3, 2)  # each model timed in bf16 instead
    picked = engine.Engine(*pair, weights="auto", on_line=engine.say)
    monkeypatch.setattr(picked.measurement, "choose_shape", lambda method, *weights: ((4, 4), "smc shape: 4x4"))
    wide, given = requests_of(picked, [{"prompt": "w1", "method": "smc"}, {"prompt": "w1", "particles": 2}],
                              max_new_tokens=8)
    assert (wide.shape.particles, wide.shape.draft_len, given.shape.particles, given.shape.draft_len) == (4, 4, 2, 4)
    assert picked.generate("w1 w2", max_new_tokens=6, seed=1).stats["particles"] == 4
    assert "(measured ms per smc cycle at 20 rows" in capsys.readouterr().err  # the formats at 4x4
    fixed = engine.Engine(*pair, weights="bf16").request("w1", max_new_tokens=8)  # a format given: no measuring
    assert (fixed.shape.particles, fixed.shape.draft_len) == (3, 2) and "smc shape" not in capsys.readouterr().err
    assert auto.clear_winner({(3, 2): 100, (3, 4): 79}, (3, 2)) == (3, 4)


def test_auto_chooses_sds_draft_length_from_the_verifys_cost_curve(pair, monkeypatch, capsys):
    """sd without --draft-len under auto: the K whose cycle (K draft steps, a verify of K + 1 rows) costs least per
    expected token, each model in its cheapest format, if clearly below K = 4's. A verify whose cost jumps past 4 rows
    (torch's int4 kernel on the CPU) gives K = 3; dear draft steps K = 2; a given K stays; measured once."""
    def costs(verify, step):  # verify {K: ms}; ar's one row 30
        return lambda cells, fmts, drafts: ({"int4": {c: verify.get(c[1], 30) for c in cells}, "bf16": {c: 500 for c
                                             in cells}}, {"int4": {c: c[1] * step for c in cells}})
    e = engine.Engine(*pair, weights="auto", on_line=engine.say)
    monkeypatch.setattr(e.measurement, "cycle_costs", costs({2: 64, 3: 68, 4: 150, 5: 160, 6: 170}, 4))
    assert requests_of(e, ["w1"], method="sd", max_new_tokens=8)[0].shape.draft_len == 3
    assert requests_of(e, ["w2"], method="sd", max_new_tokens=8, draft_len=5)[0].shape.draft_len == 5
    measuring, line, note = capsys.readouterr().err.splitlines()  # once an engine
    assert line.startswith("sd shape: K=3 (") and "K=3 32, K=4 60" in line  # (3 * 4 + 68) / (1 + .7 + .49 + .343)
    assert note == "note: sd K=3 is predicted to run at 0.95x ar here (measured matmul costs); --method ar is faster " \
        "on this machine"
    monkeypatch.setattr(e.measurement, "cycle_costs", costs({k: 60 + 5 * k for k in range(2, 7)}, 50))
    assert e.measurement.choose_shape(methods.SD)[0] == (1, 2)
    monkeypatch.setattr(e.measurement, "cycle_costs", costs({k: 60 for k in range(2, 7)}, 2))
    assert e.measurement.choose_shape(methods.SD)[0] == (1, 4)  # K = 6 is cheapest, by a millisecond: not clearly


CLI_ERRORS = [
    (["--temperature", "0"], "error: smc needs temperatures > 0"),
    (["--target", "/no/such/model"], "error: /no/such/model: no such file or directory"),
    (["--prompt-file", os.devnull], "error: .*: the prompt is empty or only whitespace"),
    (["--prompt", " \n\t "], "error: --prompt: the prompt is empty or only whitespace"),
    (["--particles", "0"], "error: particles must be at least 1"),
    (["--temperature", "nan"], "error: temperature must be a finite number, got nan"),
    (["--method", "sd", "--top-k", "1000"], r"error: top-k must lie in \[0, 8\]"),
    (["--chat"], "error: --chat: .* has no chat template"),
    (["--device", "gpu0"], "error: unknown device 'gpu0'; use cpu or cuda"),
]


@pytest.fixture(scope="module")
def cli_errors(pair):
    """The runs of CLI_ERRORS, all at once -> {their arguments: CompletedProcess}."""
    runs = run_cli(*(["--target", pair[0], "--draft", pair[1], *args] for args, _ in CLI_ERRORS))
    return {tuple(args): run for (args, _), run in zip(CLI_ERRORS, runs)}


@pytest.mark.slow
@pytest.mark.parametrize("args, message", CLI_ERRORS)
def test_cli_errors_are_one_line(cli_errors, args, message):
    run = cli_errors[tuple(args)]
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and re.match(message, lines[0])


@pytest.mark.parametrize("args, message", [
    (["--prompt", "w1 " * 64], "the prompt is 64 tokens, longer than the context of 64"),
    (["--max-new-tokens", "100"], "max-new-tokens 100 does not fit the context of 64"),
    (["--particles", str(10 ** 9), "--max-new-tokens", "8"], "the weights, 1 slots' KV caches and logits need"),
    (["--draft-len", "999"], "draft-len 999 does not fit the context of 64"),
    (["--prompt", " \n "], "--prompt: the prompt is empty or only whitespace"),
    (["--top-p", "0.5"], "smc cannot honour top-k/top-p"),
])
def test_cli_refuses_before_reading_weights_or_echoing(pair, monkeypatch, capsys, args, message):
    monkeypatch.setattr(formats, "fill_weights", lambda *a: pytest.fail("the weights were read"))
    with pytest.raises(SystemExit) as exit:
        cli.main(["--target", pair[0], "--draft", pair[1], "--prompt", "w1 w2", *args])
    assert re.match("error: .*" + re.escape(message), str(exit.value.code)) and capsys.readouterr().out == ""


def test_cli_prompt_file_not_utf8(pair, tmp_path, capsys):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f():\n    return '\xff'\n")
    with pytest.raises(SystemExit) as exit:
        cli.main(["--target", pair[0], "--draft", pair[1], "--prompt-file", str(bad)])
    assert str(exit.value.code) == f"error: {bad}: not UTF-8 text (byte 0xff at offset 21); save it as UTF-8"


def test_cli_help_describes_the_program_in_full(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "for one prompt or a .jsonl file of many, or the watch page." in " ".join(capsys.readouterr().out.split())


def test_cli_options_derive_from_settings_and_say_their_defaults(capsys):
    """Settings is the one source of the CLI's defaults, types and choices; --help says each default and, for
    --method, when to choose each method."""
    args = cli.parser().parse_args([])
    assert {name: getattr(args, name) for name in settings.command_line_settings()} == \
        {name: getattr(settings.Settings(), name) for name in settings.command_line_settings()}
    assert cli.parser().parse_args(["--no-cuda-graphs", "--easd", "2,3,0.5"]).cuda_graphs is False
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}: {spec.when}" in text for name, spec in methods.METHODS.items())
    assert "(default 64)" in text and "(default 0.7)" in text and "(default 16)" in text
    with pytest.raises(errors.UsageError, match=r"unknown select 'best' \(choose from sample, argmax\)"):
        settings.Settings(select="best").check()


def test_overlap_waits_for_both_halves_before_an_error(monkeypatch):
    """If one half's phase raises, the other half's phase, running beside it, ends before the error is raised:
    nothing is left running on the batch's tensors."""
    import time
    e = engine.Engine.of_models(TARGET, DRAFT)
    draft_block, finished = decode.draft_block, []

    def slow_draft(*args):
        time.sleep(0.3)
        draft_block(*args)
        finished.append("draft")

    def failing_verify(*args):
        raise RuntimeError("verify failed")
    def cycle(pair):
        try:
            pair_cycle(pair)
        except RuntimeError:
            raised.append(finished.count("draft"))  # the drafts done when the error left the pair
            raise
    requests = [dict(prompt=PROMPT, seed=s, max_new_tokens=12) for s in range(4)]
    pair_cycle, raised = scheduler.Pair.cycle, []
    monkeypatch.setattr(decode, "verify_cycle", failing_verify)
    monkeypatch.setattr(decode, "draft_block", slow_draft)
    monkeypatch.setattr(scheduler.Pair, "cycle", cycle)
    with pytest.raises(RuntimeError, match="verify failed"):
        e.generate(requests, method="sd", slots=4, overlap=True)
    assert raised == [2]  # the first half drafted alone, then beside the failing verify, and that draft had ended


def test_the_draft_in_a_format_of_its_own(tmp_path):
    """--draft-weights: the draft's matmuls in fp8 (a vocabulary of 16: torch._scaled_mm's multiples), the target's
    as --weights says; smc and sd decode on it. With --weights auto, which chooses both, a one-line error before any
    weight is read."""
    pair = [save(tiny(seed, vocab=16), tmp_path / role) for seed, role in enumerate(("target", "draft"))]
    e = engine.Engine(*pair, device="cpu", weights="bf16", draft_weights="fp8").load()
    assert (e.weights, e.draft_weights) == ("bf16", "fp8")
    assert e.draft.lm_head.fmt == "fp8" and not isinstance(e.target.lm_head, formats.Quantized)
    for method in ("smc", "sd"):
        assert e.generate("w1 w2", method=method, max_new_tokens=6, seed=0).stats["new_tokens"] > 0
    with pytest.raises(errors.UsageError, match="^--draft-weights with --weights auto: auto chooses both"):
        engine.Engine(*pair, device="cpu", weights="auto", draft_weights="fp8")


def test_a_qwen3_directory_and_gguf_file_run_every_method(tmp_path):
    """transformers' Qwen3 (q/k head norms, heads of 16 though 64 / 8 = 8, tied embeddings) as a GGUF file, the target,
    and as its directory, the draft: every method runs; greedy, each gives transformers' greedy tokens."""
    from test_model import qwen3_files
    hf, directory, gguf = qwen3_files(str(tmp_path))
    prompt = [5, 17, 42, 8]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    e = engine.Engine(gguf, directory, weights="float32")
    for method in engine.METHODS:
        greedy = method != "smc"  # smc weighs draws: it has no greedy form
        r = e.generate(prompt, method=method, max_new_tokens=12, temperature=0 if greedy else 0.7, seed=1)
        assert len(r.tokens) == 12 and (r.tokens == want or not greedy), method
