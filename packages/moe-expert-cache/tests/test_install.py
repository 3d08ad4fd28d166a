from importlib.metadata import version

import moe_expert_cache


def test_installed_version_matches_about():
    assert version("moe-expert-cache") == moe_expert_cache.__version__


def test_the_random_test_models_are_not_installed():
    """The random MoE writer is a test helper (membound_testing.random_moe), not package API."""
    import importlib.util

    assert importlib.util.find_spec("moe_expert_cache.random_model") is None
    assert importlib.util.find_spec("membound_testing.random_moe") is not None


def test_the_public_api_is_what_a_user_calls():
    """At most a dozen top-level names (#56); the building blocks stay in their modules."""
    import importlib

    assert len(moe_expert_cache.__all__) <= 12
    assert len(set(moe_expert_cache.__all__)) == len(moe_expert_cache.__all__)
    for name in moe_expert_cache.__all__:
        assert getattr(moe_expert_cache, name) is not None, name
    public = {n for n in vars(moe_expert_cache) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(moe_expert_cache, n)).__name__ == "module"}
    assert public - modules == set(moe_expert_cache.__all__) - {"__version__"}
    documented = {
        "config": ["MODES", "DEFAULT_CAPACITY_SHARE"],
        "policies": ["POLICIES"],
        "profile": ["adaptive_capacity", "pinned_experts"],
        "simulator": ["SIMULATED", "simulate"],
        "trace": ["RouterTrace"],
    }
    for module, names in documented.items():
        mod = importlib.import_module(f"moe_expert_cache.{module}")
        for name in names:
            assert hasattr(mod, name), f"moe_expert_cache.{module}.{name}"
