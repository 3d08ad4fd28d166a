from importlib.metadata import version

import moe_expert_cache


def test_installed_version_matches_about():
    assert version("moe-expert-cache") == moe_expert_cache.__version__


def test_the_random_test_models_are_not_installed():
    """The random MoE writer is a test helper (membound_testing.random_moe), not package API."""
    import importlib.util

    assert importlib.util.find_spec("moe_expert_cache.random_model") is None
    assert importlib.util.find_spec("membound_testing.random_moe") is not None
