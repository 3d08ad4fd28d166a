import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmrt_kv import SELECTORS, TIE_BREAKERS, BMRTError, Pool, make_selector
from bmrt_kv.selectors.simhash import SimHash, collision_counts
from bmrt_kv.selectors.tiebreak import tiebreak_bonus

SELECTOR_OPTIONS = (
    [(name, {}) for name in SELECTORS]
    + [("lsh", {"tie_breaker": tb}) for tb in TIE_BREAKERS]
    + [("keydiff", {"anchor": "stream"})]
)


def random_pool(seed, b=1, h=2, p=24, t=5, groups=2, hd=8, n_protected=4):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(p).expand(b, h, p).clone()
    candidates = torch.ones(b, h, p, dtype=torch.bool)
    candidates[..., : n_protected // 2] = False
    candidates[..., p - (n_protected - n_protected // 2) :] = False
    return Pool(
        keys=torch.randn(b, h, p, hd, generator=gen),
        positions=positions,
        queries=torch.randn(b, h, groups * t, hd, generator=gen),
        query_positions=torch.arange(p - t, p).repeat(groups),
        candidates=candidates,
        query_groups=groups,
        accumulated=torch.rand(b, h, p, generator=gen),
        key_sum=torch.randn(b, h, hd, generator=gen),
    )


@pytest.mark.parametrize(("name", "options"), SELECTOR_OPTIONS)
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    p=st.integers(8, 40),
    t=st.integers(1, 6),
    k_frac=st.floats(0.0, 1.0),
    shared=st.booleans(),
    b=st.integers(1, 2),
)
def test_selects_exactly_k_distinct_candidates(name, options, seed, p, t, k_frac, shared, b):
    pool = random_pool(seed, b=b, p=p, t=min(t, p))
    available = int(pool.candidates[0, 0].sum())
    k = round(k_frac * available)
    picked = make_selector(name, options, seed).select(pool, k, shared=shared)
    assert picked.shape == (b, 2, k)
    for row in picked.reshape(b * 2, k):
        assert len(set(row.tolist())) == k
    assert bool(pool.candidates.gather(-1, picked).all())
    if shared:
        assert torch.equal(picked[:, 0], picked[:, 1])


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_more_than_available_is_an_error(name):
    pool = random_pool(0, p=10)
    with pytest.raises(ValueError, match="k="):
        make_selector(name).select(pool, 7)


def _aligned_pool(target: int, hd: int = 16):
    """Keys are random; key ``target`` is a large multiple of the (single) query."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 20, hd, generator=gen)
    query = torch.randn(1, 1, 1, hd, generator=gen)
    keys[0, 0, target] = 6 * query[0, 0, 0]
    return Pool(
        keys=keys,
        positions=torch.arange(20).view(1, 1, 20),
        queries=query,
        query_positions=torch.tensor([19]),
        candidates=torch.ones(1, 1, 20, dtype=torch.bool),
        accumulated=torch.zeros(1, 1, 20),
    )


@pytest.mark.parametrize("name", ["exact", "lsh", "magicpig", "hybrid"])
def test_query_aligned_key_is_selected_first(name):
    pool = _aligned_pool(target=7)
    assert make_selector(name).select(pool, 1).item() == 7


def test_snapkv_keeps_the_neighbourhood_of_a_hit():
    pool = _aligned_pool(target=7)
    picked = make_selector("snapkv", {"kernel": 7}).select(pool, 7)
    assert sorted(picked[0, 0].tolist()) == list(range(4, 11))


def test_exact_with_a_kernel_keeps_the_neighbourhood_of_a_hit():
    pool = _aligned_pool(target=7)
    picked = make_selector("exact", {"kernel": 5}).select(pool, 5)
    assert sorted(picked[0, 0].tolist()) == list(range(5, 10))
    # kernel 1 (the default) is the unpooled attention mass
    unpooled = make_selector("exact").score(pool)
    torch.testing.assert_close(make_selector("exact", {"kernel": 1}).score(pool), unpooled)


def test_exact_scores_are_the_attention_mass():
    pool = random_pool(1, p=12, t=3, groups=1)
    logits = pool.queries @ pool.keys.transpose(-1, -2) / math.sqrt(pool.keys.shape[-1])
    visible = pool.positions.unsqueeze(-2) <= pool.query_positions.view(1, 1, -1, 1)
    expected = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).sum(-2)
    got = make_selector("exact").score(pool)
    torch.testing.assert_close(got.float(), expected, rtol=1e-5, atol=1e-6)


def test_query_weights_scale_each_query_contribution():
    pool = random_pool(1, p=12, t=3, groups=1)
    weights = torch.tensor([0.0, 2.0, 0.5])
    probs = make_selector("exact").score(pool)  # unweighted, for the shapes only
    from bmrt_kv.selectors.attention import attention_probs

    per_query = attention_probs(pool)  # (1, 2, 3, 12)
    pool.query_weights = weights
    weighted = make_selector("exact").score(pool)
    expected = (per_query * weights.view(1, 1, 3, 1)).sum(-2)
    torch.testing.assert_close(weighted.float(), expected)
    assert not torch.allclose(weighted, probs)


def test_streaming_keeps_the_most_recent_candidates():
    pool = random_pool(2, p=20, n_protected=4)
    picked = make_selector("streaming").select(pool, 5)
    assert sorted(picked[0, 0].tolist()) == [13, 14, 15, 16, 17]


def test_h2o_ranks_by_accumulated_attention():
    pool = random_pool(4, p=16)
    pool.accumulated = torch.zeros(1, 2, 16)
    pool.accumulated[..., 9] = 5.0
    pool.accumulated[..., 4] = 3.0
    assert make_selector("h2o").select(pool, 2)[0, 0].tolist() == [9, 4]


def test_keydiff_keeps_the_keys_that_differ_from_the_rest():
    # Filler: every key a small perturbation of one direction; two outliers point elsewhere.
    pool = random_pool(6, p=20, n_protected=4)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, generator=gen)
    pool.keys = base + 0.01 * torch.randn(1, 2, 20, 8, generator=gen)
    pool.keys[..., 7, :] = -base
    pool.keys[..., 12, :] = torch.randn(8, generator=gen)
    # A protected token that differs must not count: it is not a candidate.
    pool.keys[..., 0, :] = -3 * base
    picked = make_selector("keydiff").select(pool, 2)
    assert sorted(picked[0, 0].tolist()) == [7, 12]
    assert sorted(picked[0, 1].tolist()) == [7, 12]


def test_keydiff_stream_anchor_compares_with_the_whole_streams_mean():
    """At a small budget the kept keys are the ones that stood out, so they dominate the
    pool's own mean; the stream's mean (every key seen) still points at the filler."""
    pool = random_pool(6, p=20, n_protected=4)
    gen = torch.Generator().manual_seed(0)
    filler, rare = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    rare -= (rare @ filler) / (filler @ filler) * filler  # orthogonal to the filler
    pool.keys = rare + 0.01 * torch.randn(1, 2, 20, 8, generator=gen)  # kept: rare keys
    pool.keys[..., 9, :] = filler  # two filler keys in the new block
    pool.keys[..., 14, :] = filler
    pool.keys[..., 17, :] = -filler - rare  # unlike both
    # The pool's mean is the rare direction: the filler keys look the most different.
    assert sorted(make_selector("keydiff").select(pool, 3)[0, 0].tolist()) == [9, 14, 17]
    pool.key_sum = None
    with pytest.raises(BMRTError, match=r"needs Pool\.key_sum"):
        make_selector("keydiff", {"anchor": "stream"}).select(pool, 3)
    # The stream saw mostly filler (1000 unit keys against 18 rare ones).
    unit = torch.nn.functional.normalize
    pool.key_sum = (1000 * unit(filler, dim=0) + 18 * unit(rare, dim=0)).expand(1, 2, 8)
    picked = make_selector("keydiff", {"anchor": "stream"}).select(pool, 3)
    assert 17 in picked[0, 0].tolist() and 9 not in picked[0, 0].tolist()
    assert 14 not in picked[0, 0].tolist()


def _keydiff_pool_with_a_question(n_question: int) -> Pool:
    # Filler keys along one direction, outliers 7 and 12 elsewhere; the question's queries
    # (the last n_question of each query head) point at filler token 15 alone.
    pool = random_pool(6, p=20, t=6, n_protected=4)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, generator=gen)
    pool.keys = base + 0.01 * torch.randn(1, 2, 20, 8, generator=gen)
    pool.keys[..., 7, :] = -base
    pool.keys[..., 12, :] = torch.randn(8, generator=gen)
    orthogonal = torch.randn(8, generator=gen)
    orthogonal -= (orthogonal @ base) / (base @ base) * base
    pool.keys[..., 15, :] += 0.5 * orthogonal
    queries = pool.queries.view(1, 2, 2, 6, 8).clone()
    queries[..., :, :] = 0.0
    queries[..., 6 - n_question :, :] = 40 * orthogonal
    pool.queries = queries.reshape(1, 2, 12, 8)
    pool.n_question = n_question
    return pool


def test_keydiff_gives_the_question_its_share_of_the_slots():
    # Without a question, key difference alone: the two outliers.
    assert sorted(
        make_selector("keydiff").select(_keydiff_pool_with_a_question(0), 2)[0, 0].tolist()
    ) == [7, 12]
    # With one, half the slots go to what the question attends to (token 15 and its
    # neighbours within kernel 1), the other half to the most different key.
    pool = _keydiff_pool_with_a_question(2)
    picked = make_selector("keydiff", {"kernel": 1}).select(pool, 2)
    assert picked[0, 0, 0] == 15 and picked[0, 1, 0] == 15
    assert int(picked[0, 0, 1]) in (7, 12)
    # question_share=0: key difference alone, question or not.
    alone = make_selector("keydiff", {"question_share": 0.0}).select(pool, 2)
    assert sorted(alone[0, 0].tolist()) == [7, 12]
    # question_share=1 (and shared heads): the question picks every slot.
    every = make_selector("keydiff", {"question_share": 1.0, "kernel": 1}).select(pool, 1, True)
    assert every[0, :, 0].tolist() == [15, 15]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"question_share": 1.5}, "option 'question_share' must be a number in \\[0, 1\\]"),
        ({"question_share": True}, "option 'question_share' must be a number"),
        ({"kernel": 4}, "option 'kernel'"),
        ({"anchor": "global"}, "option 'anchor' must be one of \\['pool', 'stream'\\]"),
        ({"anchor": 1}, "option 'anchor' must be one of"),
    ],
)
def test_keydiff_refuses_bad_options(options, match):
    with pytest.raises(BMRTError, match=f"selector 'keydiff' {match}"):
        make_selector("keydiff", options)


def test_magicpig_falls_back_to_recent_tokens_when_nothing_collides():
    # With one 16-bit table no candidate can collide in >= 2 tables: all invalid.
    pool = random_pool(5, p=20, n_protected=0)
    picked = make_selector("magicpig", {"tables": 1, "bits": 16}).select(pool, 3)
    assert picked[0, 0].tolist() == [19, 18, 17]


def test_hybrid_splits_slots_between_primary_and_secondary():
    pool = random_pool(6, p=30)
    hybrid = make_selector("hybrid", {"primary": "exact", "secondary": "streaming", "ratio": 0.5})
    picked = hybrid.select(pool, 6)
    exact_top = make_selector("exact").select(pool, 3)
    assert torch.equal(picked[..., :3], exact_top)
    # The secondary (recency) fills the rest from what the primary left.
    rest = picked[0, 0, 3:].tolist()
    remaining = [i for i in range(2, 28) if i not in exact_top[0, 0].tolist()]
    assert sorted(rest) == sorted(remaining)[-3:]


def test_simhash_is_deterministic_given_a_seed():
    x = torch.randn(3, 10, 16)
    assert torch.equal(SimHash(4, 5, 7).signs(x), SimHash(4, 5, 7).signs(x))
    assert not torch.equal(SimHash(4, 5, 7).signs(x), SimHash(4, 5, 8).signs(x))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16), q=st.integers(1, 6), p=st.integers(1, 12), bits=st.integers(1, 4)
)
def test_collision_counts_match_a_double_loop(seed, q, p, bits):
    gen = torch.Generator().manual_seed(seed)
    qc = torch.randint(0, 2**bits, (1, 2, q, 3), generator=gen)
    kc = torch.randint(0, 2**bits, (1, 2, p, 3), generator=gen)
    weights = torch.rand(q, generator=gen, dtype=torch.float64)
    got = collision_counts(qc, kc, bits)
    weighted = collision_counts(qc, kc, bits, weights)
    for h in range(2):
        for j in range(p):
            hits = [(i, t) for i in range(q) for t in range(3) if qc[0, h, i, t] == kc[0, h, j, t]]
            assert got[0, h, j] == len(hits)
            assert abs(float(weighted[0, h, j]) - sum(float(weights[i]) for i, _ in hits)) < 1e-9


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 3), min_size=2, max_size=15),
    seed=st.integers(0, 1000),
)
def test_tiebreak_bonus_orders_by_count_then_distance(counts, seed):
    gen = torch.Generator().manual_seed(seed)
    distance = torch.rand(1, 1, len(counts), generator=gen)
    score = torch.tensor(counts, dtype=torch.float64).view(1, 1, -1) + tiebreak_bonus(distance)
    order = torch.sort(score, descending=True, stable=True).indices[0, 0].tolist()
    expected = sorted(range(len(counts)), key=lambda i: (-counts[i], float(distance[0, 0, i])))
    assert order == expected


@pytest.mark.parametrize("name", [n for n in TIE_BREAKERS if n != "none"])
def test_tie_breakers_prefer_a_key_at_the_query(name):
    gen = torch.Generator().manual_seed(9)
    queries = torch.randn(1, 1, 32, 8, generator=gen)
    keys = torch.randn(1, 1, 10, 8, generator=gen) * 5
    keys[0, 0, 4] = queries[0, 0].mean(0)  # at the mean (and near every chunk centroid)
    if name == "max_sim":
        keys[0, 0, 4] = queries[0, 0, 11]
    distance = TIE_BREAKERS[name](keys, queries)
    assert int(distance.argmin()) == 4


def test_simhash_projects_even_when_head_dim_equals_the_code_width():
    # 16 tables x 4 bits = 64 = SmolLM2's head_dim: codes() used to take such an input for
    # signs already computed and hash the raw coordinates, with no random planes at all.
    hash_ = SimHash(16, 4, 3)
    x = torch.randn(2, 5, 64)
    bits = (x @ hash_.planes(64, x.device, x.dtype) > 0).view(2, 5, 16, 4).long()
    expected = (bits * 2 ** torch.arange(4)).sum(-1)
    assert torch.equal(hash_.codes(x), expected)
    assert torch.equal(hash_.codes_from_signs(hash_.signs(x)), expected)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_options_are_validated_dataclass_fields(name):
    cls = SELECTORS[name]
    assert dataclasses.is_dataclass(cls)
    options = [f.name for f in dataclasses.fields(cls) if f.name != "seed"]
    selector = make_selector(name, {}, seed=3)
    assert selector.seed == 3
    for option in options:  # every option is visible on the instance and in its repr
        assert f"{option}=" in repr(selector)
    with pytest.raises(BMRTError, match=f"the seed of selector {name!r}"):
        cls(seed=-1)


@pytest.mark.parametrize(
    ("name", "option", "bad"),
    [
        ("exact", "kernel", 2),
        ("snapkv", "window", 0),
        ("lsh", "bits", 17),
        ("lsh", "tie_breaker", "x"),
        ("magicpig", "tables", 256),
        ("hybrid", "ratio", 1.5),
        ("hybrid", "primary", "hybrid"),
    ],
)
def test_a_bad_option_is_refused_at_construction_naming_it(name, option, bad):
    with pytest.raises(BMRTError, match=f"selector {name!r} option {option!r}"):
        SELECTORS[name](**{option: bad})


@pytest.mark.parametrize(
    ("name", "arxiv"),
    [
        ("snapkv", "2404.14469"),
        ("keydiff", "2504.15364"),
        ("h2o", "2306.14048"),
        ("streaming", "2309.17453"),
        ("magicpig", "2410.16179"),
    ],
)
def test_each_published_selector_links_its_paper(name, arxiv):
    assert f"https://arxiv.org/abs/{arxiv}" in SELECTORS[name].__doc__
