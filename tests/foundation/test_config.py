"""LynxConfig: parsing, validation messages that name the field, and the trip through the environment."""

from __future__ import annotations

import json

import pytest

from sglang_lynx.config import LYNX_CONFIG_ENV, MODES, LynxConfig, LynxConfigError


def test_defaults_are_valid_and_progressive() -> None:
    config = LynxConfig()
    assert config.mode == "lynx" and config.progressive
    assert config.page_tokens % config.chunk_tokens == 0


@pytest.mark.parametrize("mode", MODES)
def test_bare_mode_name(mode: str) -> None:
    config = LynxConfig.parse(mode)
    assert config.mode == mode
    assert config.progressive == (mode in ("lynx", "lynx-exact"))


def test_json_text_and_file_give_the_same_config(tmp_path) -> None:
    text = json.dumps({"mode": "lynx-int8", "chunk_tokens": 16, "alpha": 3})
    path = tmp_path / "lynx.json"
    path.write_text(text)
    assert LynxConfig.parse(text) == LynxConfig.parse(str(path))
    assert LynxConfig.parse(text).alpha == 3.0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"mode": "int3"}', "mode"),
        ('{"page_tokens": 100}', "page_tokens"),
        ('{"chunk_tokens": 512}', "chunk_tokens"),
        ('{"value_group_size": 48}', "value_group_size"),
        ('{"alpha": -1}', "alpha"),
        ('{"alpha": "NaN"}', "alpha"),
        ('{"max_draft_tokens": 0}', "max_draft_tokens"),
        ('{"max_draft_tokens": true}', "max_draft_tokens"),
        ('{"fallback": "retry"}', "fallback"),
        ('{"residual_timeout_s": 0}', "residual_timeout_s"),
        ('{"verify_tie_margin": -0.5}', "verify_tie_margin"),
        ('{"verify_tie_margin": "x"}', "verify_tie_margin"),
        ('{"verify_first_pass": -1}', "verify_first_pass"),
        ('{"verify_first_pass": 2.5}', "verify_first_pass"),
        ('{"verify_bonus_token": 1}', "verify_bonus_token"),
        ('{"stream_last_page": "yes"}', "stream_last_page"),
        ('{"exact_threads": -1}', "exact_threads"),
        ('{"exact_threads": 1.5}', "exact_threads"),
        ('{"modee": "lynx"}', "modee"),
        ('["lynx"]', "JSON object"),
        ("{not json", "not valid JSON"),
        ("/no/such/file.json", "neither a JSON object"),
    ],
)
def test_bad_values_name_the_field(text: str, field: str) -> None:
    with pytest.raises(LynxConfigError, match=field):
        LynxConfig.parse(text)


def test_publish_and_read_back() -> None:
    env: dict[str, str] = {}
    assert LynxConfig.from_env(env) is None
    config = LynxConfig(mode="kivi-int4", residual_window=3)
    config.publish(env)
    assert LYNX_CONFIG_ENV in env
    assert LynxConfig.from_env(env) == config


def test_every_mode_names_a_registered_codec() -> None:
    from sglang_lynx.codec.registry import codec_names, get_codec

    for mode in MODES:
        config = LynxConfig(mode=mode)
        assert config.codec_name in codec_names()
        assert get_codec(config.codec_name, **config.codec_params()).name == config.codec_name


def test_lynx_exact_needs_alpha_zero() -> None:
    assert LynxConfig(mode="lynx-exact").exact and not LynxConfig(mode="lynx").exact
    with pytest.raises(LynxConfigError, match="alpha"):
        LynxConfig(mode="lynx-exact", alpha=3.0)


def test_exact_threads_automatic_is_a_quarter_of_the_cores_from_1_to_8() -> None:
    auto = LynxConfig(mode="lynx-exact")
    assert auto.exact_threads == 0
    assert [auto.exact_thread_count(c) for c in (1, 2, 4, 7, 8, 16, 64, 256)] == [1, 1, 1, 1, 2, 4, 8, 8]
    assert LynxConfig(mode="lynx-exact", exact_threads=3).exact_thread_count(2) == 3  # as given
