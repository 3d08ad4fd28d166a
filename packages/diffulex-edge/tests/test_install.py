from importlib.metadata import version

import diffulex_edge


def test_installed_version_matches_about():
    assert version("diffulex-edge") == diffulex_edge.__version__
