from importlib.metadata import version

import zstd_linear


def test_installed_version_matches_about():
    assert version("zstd-linear") == zstd_linear.__version__


def test_ships_py_typed():
    from importlib.resources import files

    assert files("zstd_linear").joinpath("py.typed").is_file()
