"""compress_model's progress bar: on by default when compressing takes long, and drawn
before the first layer is encoded (#19: the CLI's first update came after 18.7 s)."""

from __future__ import annotations

from conftest import make_toy

import zstd_linear.model as model_module
from zstd_linear import compress_model
from zstd_linear.progress import ProgressBar


def test_no_bar_by_default_for_a_small_model(capsys):
    compress_model(make_toy(), level=1)
    assert capsys.readouterr().err == ""


def test_bar_by_default_past_the_size_threshold(capsys, monkeypatch):
    toy = make_toy()
    weights = sum(p.nbytes for n, p in toy.named_parameters() if n.endswith("weight"))
    monkeypatch.setattr(model_module, "PROGRESS_MIN_BYTES", weights)
    compress_model(toy, level=1)
    err = capsys.readouterr().err
    assert "compress [" in err and "9/9" in err
    assert compress_model(make_toy(), level=1, progress=False) is not None
    assert capsys.readouterr().err == ""


def test_the_bar_is_drawn_before_the_first_layer_is_encoded(monkeypatch):
    events: list[str] = []

    class RecordingBar(ProgressBar):
        def _draw(self, note):
            events.append(f"draw {self.done}")
            super()._draw(note)

    encode = model_module.encode_weight

    def recording_encode(weight, config):
        events.append("encode")
        return encode(weight, config)

    monkeypatch.setattr(model_module, "ProgressBar", RecordingBar)
    monkeypatch.setattr(model_module, "encode_weight", recording_encode)
    compress_model(make_toy(), level=1, progress=True, threads=1)
    assert events[0] == "draw 0", events
    assert events.count("encode") == 9 and events[-1] == "draw 9"
