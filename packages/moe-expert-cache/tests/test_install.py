from importlib.metadata import version

import moe_expert_cache


def test_installed_version_matches_about():
    assert version("moe-expert-cache") == moe_expert_cache.__version__


def test_the_test_model_builders_are_not_installed():
    """The random MoE writer and the MoEfication of a dense model are test-model builders
    (membound_testing.random_moe and membound_testing.moefy, 0.10.0), not package API.
    The top-level API's size is checked in test_structure.py."""
    import importlib.util

    assert importlib.util.find_spec("moe_expert_cache.random_model") is None
    assert importlib.util.find_spec("moe_expert_cache.moefy") is None
    assert importlib.util.find_spec("moe_expert_cache.calibration") is None
    assert importlib.util.find_spec("membound_testing.random_moe") is not None
    assert importlib.util.find_spec("membound_testing.moefy") is not None
