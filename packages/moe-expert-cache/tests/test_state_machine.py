"""ExpertSlots + policies as a state machine against a plain set of resident experts."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from moe_expert_cache.policies import POLICIES, make_policy
from moe_expert_cache.slots import ExpertSlots

E, K = 10, 2


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(K, E),
        policy=st.sampled_from(sorted(POLICIES)),
        data=st.data(),
    )
    def setup(self, capacity, policy, data):
        pinned = data.draw(st.sets(st.integers(0, E - 1), max_size=capacity - K))
        self.slots = ExpertSlots(E, capacity, K, pinned)
        self.policy = make_policy(policy, E)
        # The documented initial fill: pinned experts, then the lowest ids.
        self.model = set(
            sorted(pinned) + [e for e in range(E) if e not in pinned][: capacity - len(pinned)]
        )
        self.pinned = set(pinned)
        self.capacity = capacity
        self.step = 0

    def _apply(self, swaps, requested, limit):
        if limit is not None:
            assert len(swaps) <= limit
        for _, evicted, loaded in swaps:
            assert evicted in self.model and loaded not in self.model
            assert evicted not in self.pinned and evicted not in requested
            self.model.remove(evicted)
            self.model.add(loaded)
        self.slots.apply(swaps)

    @rule(data=st.data())
    def request_token(self, data):
        """Exact mode: one token's experts must all be resident afterwards."""
        row = data.draw(st.lists(st.integers(0, E - 1), min_size=K, max_size=K, unique=True))
        missing = [e for e in row if e not in self.model]
        swaps = self.slots.plan(missing, row, self.policy, self.step)
        self._apply(swaps, set(row), None)
        assert set(row) <= self.model
        self.policy.record(row, self.step)
        self.step += 1

    @rule(
        wanted=st.lists(st.integers(0, E - 1), max_size=6, unique=True),
        limit=st.integers(0, 3),
    )
    def budgeted_update(self, wanted, limit):
        """Skip mode between tokens: at most ``limit`` swaps."""
        swaps = self.slots.plan(wanted, [], self.policy, self.step, limit)
        self._apply(swaps, set(), limit)
        self.step += 1

    @rule(data=st.data())
    def bad_apply_changes_nothing(self, data):
        before = (self.slots.slot_to_expert.copy(), self.slots.expert_to_slot.copy())
        resident = sorted(self.model)
        loaded = data.draw(st.sampled_from(resident))
        try:
            self.slots.apply([(0, int(self.slots.slot_to_expert[0]), loaded)])
        except ValueError:
            pass
        else:
            raise AssertionError("loading a resident expert must be refused")
        assert (self.slots.slot_to_expert == before[0]).all()
        assert (self.slots.expert_to_slot == before[1]).all()

    @invariant()
    def bijection_and_capacity(self):
        s2e, e2s = self.slots.slot_to_expert, self.slots.expert_to_slot
        assert len(s2e) == self.capacity and len(set(s2e.tolist())) == self.capacity
        for slot, e in enumerate(s2e):
            assert e2s[e] == slot
        assert int((e2s >= 0).sum()) == self.capacity

    @invariant()
    def matches_model_and_keeps_pins(self):
        assert self.slots.resident() == self.model
        assert self.pinned <= self.model


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
