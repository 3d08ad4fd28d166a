"""The cache against a dumb model of what it must keep, over random feeds and decodes."""

import torch
from conftest import VOCAB, _build
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from bmrt_kv import SELECTORS, BMRTCache, BMRTConfig

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = _build("llama")
    return MODEL


class BoundedCacheMachine(RuleBasedStateMachine):
    """The model: the list of positions fed so far (a stream never forgets what it saw)."""

    @initialize(
        selector=st.sampled_from(sorted(SELECTORS)),
        budget=st.integers(9, 24),
        divisor=st.integers(3, 4),
        block=st.integers(1, 10),
        granularity=st.sampled_from(["head", "layer"]),
        positions=st.sampled_from(["absolute", "rerotate"]),
    )
    def start(self, selector, budget, divisor, block, granularity, positions):
        self.config = BMRTConfig(
            budget=budget,
            protection_divisor=divisor,
            block_size=block,
            selector=selector,
            granularity=granularity,
            positions=positions,
        )
        self.cache = BMRTCache(model(), self.config)
        self.fed: list[int] = []
        self.gen = torch.Generator().manual_seed(budget * 31 + block)

    @rule(data=st.data())
    def feed_block(self, data):
        n = data.draw(st.integers(1, self.config.block_size))
        ids = torch.randint(0, VOCAB, (1, n), generator=self.gen)
        with torch.no_grad():
            model()(input_ids=ids, past_key_values=self.cache)
        self.fed.extend(range(len(self.fed), len(self.fed) + n))

    @rule()
    def decode_step(self):
        ids = torch.randint(0, VOCAB, (1, 1), generator=self.gen)
        with torch.no_grad():
            model()(input_ids=ids, past_key_values=self.cache)
        self.fed.append(len(self.fed))

    @invariant()
    def seq_length_counts_the_stream(self):
        assert self.cache.get_seq_length() == len(self.fed)

    @invariant()
    def budget_never_exceeded(self):
        for layer in self.cache.layers:
            assert layer.stored == min(len(self.fed), self.config.budget)
            assert layer.peak_tokens <= self.config.budget + self.config.block_size

    @invariant()
    def anchors_and_window_kept_positions_valid(self):
        if not self.fed:
            return
        seen = len(self.fed)
        anchors = set(self.fed[: self.config.n_anchor])
        window = set(self.fed[-self.config.n_window :])
        for layer in self.cache.layers:
            for row in layer.positions.reshape(-1, layer.stored).tolist():
                assert row == sorted(set(row)), "positions distinct and sorted"
                assert all(0 <= p < seen for p in row)
                assert anchors <= set(row) and window <= set(row)


BoundedCacheMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=10, deadline=None
)
TestBoundedCache = BoundedCacheMachine.TestCase
