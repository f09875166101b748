"""A draft and a target of different vocabulary sizes, as Qwen2.5-7B (152,064 rows) and its 0.5B draft (151,936),
both padded past their tokenizer's tokens: the ids they share sampled by every method alike, the others never, so sd
stays exact against ar's distribution; a draft that tokenizes otherwise refused in one line."""

import pytest
import torch

import engine
import errors
import kernels
from test_engine import (PROMPT, SAMPLES, V, empirical, exact, noise_floor, perturbed, reference_kernels,  # noqa: F401
                         save, tiny, tv, words)

METHODS = ["ar", "sd", "mdsd", "smc", "easd"]


def with_rows(m, rows, seed):
    """m with `rows` embedding and head rows: its first ones, then another random model's, pulled towards every hidden
    state (the target's two past the draft's take 15% of its first token's mass, its four past the tokenizer's 44%):
    rows past the ids both models share, which a method that samples them at all samples often."""
    out = tiny(seed, 0.8, vocab=rows, head_dim=m.config.head_dim)
    n = min(rows, m.config.vocab_size)
    with torch.no_grad():
        for (name, p), q in zip(out.named_parameters(), m.parameters()):
            if name in ("embed", "lm_head"):
                p[:n] = q[:n]
            else:
                p.copy_(q)
        out.lm_head[n:] += 2.0 * out.norm
    return out


BASE = tiny(0, 0.8)
TARGET = with_rows(BASE, V + 4, 7)  # the real target's shape: more rows than the draft, both past the tokenizer
DRAFT = with_rows(perturbed(BASE, 1, 0.3), V + 2, 8)
SHARED = V + 2  # of_models: no tokenizer, so the rows both models have


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The pair as files whose tokenizers hold V words, fewer than either model's rows."""
    root = tmp_path_factory.mktemp("vocab")
    return {name: words(save(m, str(root / name)), V) for name, m in (("target", TARGET), ("draft", DRAFT))}


def test_the_pair_shares_the_tokenizers_ids(files, tmp_path):
    """Files: the ids below both models' rows and both tokenizers' tokens, padding rows cut, with a draft alone too;
    a draft whose tokenizer goes on past the target's pairs with it."""
    e = engine.Engine(files["target"], files["draft"], weights="float32")
    assert e.vocab == e.pad == V and e.config.vocab_size == V + 4 and e.draft_config.vocab_size == V + 2
    assert engine.Engine(files["target"], weights="float32").vocab == V
    longer = words(save(with_rows(DRAFT, V + 4, 9), str(tmp_path / "longer")), V + 3)
    assert engine.Engine(files["target"], longer, weights="float32").vocab == V
    assert engine.Engine.of_models(TARGET, DRAFT).vocab == SHARED
    assert engine.Engine.of_models(DRAFT, TARGET).vocab == SHARED
    with pytest.raises(errors.UsageError, match=rf"prompt token ids must lie in \[0, {V}\)"):
        e.generate([1, V])


def test_a_draft_that_tokenizes_otherwise_is_refused_before_any_weight(files, tmp_path, monkeypatch):
    """Refused as the files open: before the formats are chosen (auto's measuring) and any weight is read."""
    other = words(save(DRAFT, str(tmp_path / "other")), V, changed=5)
    monkeypatch.setattr(engine.Engine, "choose_formats", None)
    with pytest.raises(errors.UsageError) as refused:
        engine.Engine(files["target"], other, weights="float32")
    message = str(refused.value)
    assert "\n" not in message and files["target"] in message and other in message
    assert "id 5 is 'other' in the draft, 'w5' in the target" in message and "tokenizer family" in message


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd", "ar"])
def test_sd_samples_ars_distribution_on_the_shared_ids(method):
    """The target's softmax over the shared ids (the mass of its extra rows dropped) is what ar samples
    and what sd samples through a draft of fewer rows: x0, then one cycle of K = 2."""
    target = exact(TARGET, 4, 1.0, vocab=SHARED)
    e = engine.Engine.of_models(TARGET, DRAFT)
    found = empirical(e, SAMPLES, 4, method=method, temperature=1.0, draft_len=2)
    assert tv(found, target) < noise_floor(target, SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("method, particles", [("mdsd", 3), ("sd", 1)])
def test_exact_methods_sample_the_shared_ids_on_the_cpu_wing(files, method, particles):
    """The same from the files (the tokenizer's V ids shared), on the CPU platform's backend and its sampling."""
    e = engine.Engine(files["target"], files["draft"], weights="float32")
    target = exact(TARGET, 4, 1.0, vocab=V)
    found = empirical(e, SAMPLES, 4, method=method, particles=particles, temperature=1.0, draft_len=2)
    assert tv(found, target) < noise_floor(target, SAMPLES)


@pytest.mark.parametrize("longer", ["target", "draft"])
def test_smc_weighs_nothing_where_the_draft_is_the_target_on_the_shared_ids(longer):
    """A draft with the target's rows on the shared ids, and more or fewer past them: both distributions are the
    softmax over the shared ids, so every weight increment is 0 and nothing resamples."""
    short = with_rows(TARGET, SHARED, 3)
    pair = (TARGET, short) if longer == "target" else (short, TARGET)
    r = engine.Engine.of_models(*pair).generate(PROMPT, method="smc", particles=4, draft_len=3, max_new_tokens=16,
                                                temperature=0.7, lag=0)
    assert r.stats["resamples"] == 0 and r.stats["mean_ess"] == 4 and abs(r.stats["log_z"]) < 1e-4


def every_method(e, racer):
    """Each method on the pair e, and sd on racer's drafts (racer: an engine of e's target), at T = 1 samples only
    the engine's ids (e.vocab); greedy sd and mdsd give ar's tokens."""
    for method in METHODS:
        for seed in range(3):
            r = e.generate(PROMPT, method=method, particles=2, draft_len=2, max_new_tokens=10, temperature=1.0,
                           seed=seed)
            assert len(r.tokens) == 10 and all(0 <= t < e.vocab for t in r.tokens), method
    greedy = dict(temperature=0, max_new_tokens=12, draft_len=3)
    ar = e.generate(PROMPT, method="ar", **greedy).tokens
    assert all(t < e.vocab for t in ar)
    assert e.generate(PROMPT, method="sd", **greedy).tokens == ar
    assert e.generate(PROMPT, method="mdsd", particles=2, **greedy).tokens == ar
    assert racer.generate(PROMPT, method="sd", **greedy).tokens == racer.generate(PROMPT, method="ar", **greedy).tokens
    drafted = racer.generate(PROMPT, method="sd", draft_len=2, max_new_tokens=10, temperature=1.0).tokens
    assert all(t < racer.vocab for t in drafted)


def test_every_method_runs_on_the_pair_on_the_reference_kernels():
    """Models built here: no tokenizer, so the ids both have (a longer draft's or target's extra rows cut)."""
    every_method(engine.Engine.of_models(TARGET, DRAFT), engine.Engine.of_models(TARGET, "racer"))
    every_method(engine.Engine.of_models(DRAFT, TARGET), engine.Engine.of_models(DRAFT, "racer"))


def test_every_method_runs_on_the_pair_on_the_cpu_wing(files):
    """The CPU platform's backend (the compiled sampling where it builds) on the files' pair, the tokenizer's V ids
    shared; racer drafts on the target's file alone, its padding cut all the same."""
    e = engine.Engine(files["target"], files["draft"], weights="float32")
    racer = engine.Engine(files["target"], "racer", weights="float32")
    assert racer.vocab == V
    every_method(e, racer)
    assert set(e.generate("w1 w2", method="ar", max_new_tokens=6).text.split()) <= {f"w{i}" for i in range(V)}


def test_the_triton_sampling_reads_logits_cut_from_wider_rows(monkeypatch):
    """Where the logits are a view of the shared ids in rows of more (a row's stride past its length), the Triton
    kernels draw and score as on those ids copied out."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    rows = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    cut = rows[:, :33]  # [6, 33] of rows of 40
    temperature = torch.tensor([0.7, 1.0])  # two requests of 3 rows
    rng = kernels.make_rng([3, 4], "cpu")
    tokens, logprobs = kernels.sample(cut, temperature, rng.clone())
    want, want_logprobs = kernels.sample(cut.contiguous(), temperature, rng.clone())
    assert tokens.tolist() == want.tolist() and bool((tokens < 33).all())
    assert torch.allclose(logprobs, want_logprobs)
    scored = kernels.token_logprobs(cut, tokens, temperature)
    assert torch.allclose(scored, kernels.token_logprobs_ref(cut.contiguous(), tokens, temperature), atol=1e-5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log2(0) = -inf
def test_every_method_runs_on_the_pair_through_the_interpreted_triton_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    if not kernels.use_triton(torch.empty(0)):
        pytest.skip("no triton")
    target = with_rows(tiny(0, 0.8, vocab=16, head_dim=16), 20, 7)
    draft = with_rows(perturbed(tiny(0, 0.8, vocab=16, head_dim=16), 1, 0.3), 18, 8)
    e = engine.Engine.of_models(target, draft)
    for method in METHODS:
        r = e.generate(PROMPT, method=method, particles=2, draft_len=2, max_new_tokens=4, temperature=1.0)
        assert len(r.tokens) == 4 and all(0 <= t < 18 for t in r.tokens), method
