"""The L3 flags (--hicache-storage-backend file|redis, --hicache-storage-url): checked in
EngineConfig and passed by the CLI; the engine does not use them yet (issue 15, the step after the storage
foundation)."""
from __future__ import annotations

import pytest

from ketch.cache.storage import BACKENDS
from ketch.cli import build_parser, main
from ketch.cli_args import engine_kwargs
from ketch.config import _STORAGE_URL_FORMS, HICACHE_STORAGE_BACKENDS, EngineConfig

ON = dict(enable_hierarchical_cache=True)


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_storage_backend="file"), "hicache_storage_backend"),
    (dict(hicache_storage_backend="file", hicache_storage_url="file:///tmp/kv"), "hicache_storage_backend"),
])
def test_a_storage_option_without_the_switch_says_to_add_it(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} .*add --enable-hierarchical-cache"):
        EngineConfig(**kw)
    EngineConfig(**ON, **kw)  # with the switch: fine


@pytest.mark.parametrize("url,backend", [("file:///tmp/kv", "file"), ("redis://127.0.0.1:6379/0", "redis")])
def test_a_url_alone_asks_for_the_backend_its_scheme_names(url: str, backend: str) -> None:
    with pytest.raises(ValueError, match=f"^hicache_storage_url needs a backend: add --hicache-storage-backend {backend}$"):
        EngineConfig(hicache_storage_url=url)


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_storage_backend="s3"), "hicache_storage_backend"),
    (dict(hicache_storage_url="file:///tmp/kv"), "hicache_storage_url"),  # a url needs a backend
    (dict(hicache_storage_backend="file", hicache_storage_url="/tmp/kv"), "hicache_storage_url"),
    (dict(hicache_storage_backend="file", hicache_storage_url="file://relative"), "hicache_storage_url"),
])
def test_bad_storage_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**ON, **kw)


@pytest.mark.parametrize("backend,url,form", [
    ("redis", "file:///tmp/kv", "redis://host:port"),
    ("redis", "/tmp/kv", "redis://host:port"),
    ("redis", "127.0.0.1:6379", "redis://host:port"),
    ("file", "redis://127.0.0.1:6379/0", "file:///absolute/dir"),
])
def test_a_url_of_another_backend_names_the_field_and_the_form(backend: str, url: str, form: str) -> None:
    with pytest.raises(ValueError, match=f"^hicache_storage_url: the {backend} backend takes {form}"):
        EngineConfig(**ON, hicache_storage_backend=backend, hicache_storage_url=url)


def test_the_redis_backend_with_its_url_or_the_default() -> None:
    cfg = EngineConfig(**ON, hicache_storage_backend="redis", hicache_storage_url="redis://10.0.0.5:7000/2")
    assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("redis", "redis://10.0.0.5:7000/2")
    assert EngineConfig(**ON, hicache_storage_backend="redis").hicache_storage_url is None  # redis://127.0.0.1:6379/0
    with pytest.raises(ValueError, match="^hicache_storage_backend .*add --enable-hierarchical-cache"):
        EngineConfig(hicache_storage_backend="redis")


def test_good_storage_configs_and_one_list_of_backends() -> None:
    assert EngineConfig(**ON).hicache_storage_backend is None
    cfg = EngineConfig(**ON, hicache_storage_backend="file", hicache_storage_url="file:///tmp/kv")
    assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("file", "file:///tmp/kv")
    assert EngineConfig(**ON, hicache_storage_backend="file").hicache_storage_url is None  # the default dir
    assert BACKENDS is HICACHE_STORAGE_BACKENDS
    assert set(_STORAGE_URL_FORMS) == set(HICACHE_STORAGE_BACKENDS)  # each backend's URL is checked


def test_cli_storage_flags_reach_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-url", "file:///tmp/kv"]
    for argv in (["serve", *flags], ["generate", "hi", *flags], ["bench", "offline", *flags]):
        cfg = EngineConfig(**engine_kwargs(parser.parse_args(argv)))
        assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("file", "file:///tmp/kv")
    redis_flags = ["serve", "--enable-hierarchical-cache", "--hicache-storage-backend", "redis"]
    cfg = EngineConfig(**engine_kwargs(parser.parse_args([*redis_flags, "--hicache-storage-url", "redis://h:1/0"])))
    assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("redis", "redis://h:1/0")
    assert EngineConfig(**engine_kwargs(parser.parse_args(["serve"]))).hicache_storage_backend is None
    assert main(["generate", "hi", "--hicache-storage-backend", "file"]) == 2  # before any model loads
    assert "add --enable-hierarchical-cache" in capsys.readouterr().err
