from importlib.metadata import version

import bmrt_kv


def test_installed_version_matches_about():
    assert version("bmrt-kv") == bmrt_kv.__version__
