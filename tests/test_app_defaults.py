"""The settings a new user starts with come from resources/default-settings.json."""
from pathlib import Path


def test_fresh_settings_ship_the_speed_projection_configured_but_off():
    from app import settings
    s = settings.load()                       # STRATA_HOME is an empty tmp folder (conftest)
    assert s.cache_mib == 1024 and s.cache_slots == 4
    assert s.steering.mode == "project" and not s.steering.on_by_default
    (path, scale), = s.steering.files
    assert Path(path).is_file() and path.endswith("smollm2-135m-concise.gguf") and scale == 2.0
    assert (s.steering.layer_from, s.steering.layer_to) == (4, 20)


def test_saved_settings_win_over_the_shipped_defaults():
    from app import settings
    s = settings.load()
    s.steering.files = []
    s.sampling.max_tokens = 64
    settings.save(s)
    again = settings.load()
    assert again.steering.files == [] and again.sampling.max_tokens == 64
