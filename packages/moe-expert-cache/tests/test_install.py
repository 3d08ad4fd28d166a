from importlib.metadata import version

import moe_expert_cache


def test_installed_version_matches_about():
    assert version("moe-expert-cache") == moe_expert_cache.__version__
