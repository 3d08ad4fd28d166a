from importlib.metadata import version

import paired_cache


def test_installed_version_matches_about():
    assert version("paired-cache") == paired_cache.__version__
