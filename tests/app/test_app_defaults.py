"""The settings a new user starts with come from resources/default-settings.json."""
from pathlib import Path


def test_fresh_settings_ship_the_speed_projection_configured_but_off():
    from app import settings
    s = settings.load()                       # STRATA_HOME is an empty tmp folder (conftest)
    assert s.cache_mib == 1024 and s.cache_slots == 4
    assert s.steering.mode == "project" and not s.steering.speed_projection
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


def test_a_settings_file_with_the_old_switch_name_still_loads():
    """`steering/on_by_default` was the speed projection switch's key: it is read as speed_projection,
    and the next save writes only the new key."""
    from PySide6.QtCore import QSettings

    from app import paths, settings
    q = QSettings(str(paths.settings_path()), QSettings.Format.IniFormat)
    q.setValue("steering/on_by_default", True)
    q.sync()
    s = settings.load()
    assert s.steering.speed_projection is True
    s.steering.speed_projection = False
    settings.save(s)
    q = QSettings(str(paths.settings_path()), QSettings.Format.IniFormat)
    assert not q.contains("steering/on_by_default") and settings.load().steering.speed_projection is False


def test_sampling_fields_and_defaults_come_from_the_engine_table():
    from dataclasses import fields

    from app.presets import Preset
    from app.settings import Sampling
    from engine.limits import DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS
    from engine.sampling import APP_FIELDS, FIELD, SamplingParams
    s, p = Sampling(), Preset()
    for f in APP_FIELDS:
        assert getattr(s, f.name) == getattr(p, f.name) == f.chat_default
        assert getattr(SamplingParams(), f.name) == f.default
        lo, hi, _step, _decimals = f.form
        assert f.lo <= lo and hi <= f.hi         # the app's form stays inside the engine's range
    assert set(p.sampling()) == {f.name for f in APP_FIELDS}
    assert {f.name for f in fields(Sampling)} <= {f.name for f in fields(Preset)}
    assert FIELD["temperature"].api_default == 1.0
    from app import settings
    fresh = settings.load()
    assert (fresh.cache_mib, fresh.cache_slots) == (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS)


def test_the_app_data_folder_is_the_engines():
    import os

    import engine.paths
    from app.paths import AppPaths
    before = dict(os.environ)
    p = AppPaths.default()
    assert p.data_dir == engine.paths.data_dir() and p.models_dir == engine.paths.models_dir()
    assert dict(os.environ) == before


def test_files_an_older_app_kept_in_qts_folder_move_to_the_one_data_folder(tmp_path):
    from app.paths import AppPaths, adopt_legacy
    legacy, new = tmp_path / "Strata" / "Strata", tmp_path / "strata"
    (legacy / "models").mkdir(parents=True)
    (legacy / "models" / "m.gguf").write_bytes(b"GGUF")
    (legacy / "settings.ini").write_text("[app]\n")
    (legacy / "chats.sqlite3").write_bytes(b"db")
    (legacy / "chats.sqlite3-wal").write_bytes(b"wal")
    new.mkdir()
    (new / "sessions").mkdir()
    (new / "sessions" / "mine.stratasession").write_bytes(b"x")      # the new folder's own: kept
    (legacy / "sessions").mkdir()
    paths = AppPaths(new)
    assert paths.models_dir.is_dir()                                   # an empty models/ counts as none
    assert adopt_legacy(paths, legacy) == ["settings.ini", "chats.sqlite3", "chats.sqlite3-wal", "models"]
    assert (new / "models" / "m.gguf").read_bytes() == b"GGUF" and (new / "chats.sqlite3-wal").exists()
    assert (legacy / "sessions").is_dir() and (new / "sessions" / "mine.stratasession").exists()
    assert adopt_legacy(paths, legacy) == [] and adopt_legacy(paths, None) == [] and adopt_legacy(paths, new) == []
