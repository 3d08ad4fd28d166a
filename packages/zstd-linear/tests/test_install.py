from importlib.metadata import version

import zstd_linear


def test_installed_version_matches_about():
    assert version("zstd-linear") == zstd_linear.__version__
