"""The L3 flags (--hicache-storage-backend, --hicache-storage-url): checked in EngineConfig and
passed by the CLI; the engine does not use them yet (issue 15, the step after the storage
foundation)."""
from __future__ import annotations

import pytest

from ketch.cache.storage import BACKENDS
from ketch.cli import build_parser, main
from ketch.cli_args import engine_kwargs
from ketch.config import HICACHE_STORAGE_BACKENDS, EngineConfig

ON = dict(enable_hierarchical_cache=True)


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_storage_backend="file"), "hicache_storage_backend"),
    (dict(hicache_storage_backend="file", hicache_storage_url="file:///tmp/kv"), "hicache_storage_backend"),
])
def test_a_storage_option_without_the_switch_says_to_add_it(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} .*add --enable-hierarchical-cache"):
        EngineConfig(**kw)
    EngineConfig(**ON, **kw)  # with the switch: fine


def test_a_url_alone_asks_for_the_backend_first() -> None:
    with pytest.raises(ValueError, match="^hicache_storage_url needs a backend: add --hicache-storage-backend file"):
        EngineConfig(hicache_storage_url="file:///tmp/kv")


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_storage_backend="redis"), "hicache_storage_backend"),
    (dict(hicache_storage_url="file:///tmp/kv"), "hicache_storage_url"),  # a url needs a backend
    (dict(hicache_storage_backend="file", hicache_storage_url="/tmp/kv"), "hicache_storage_url"),
    (dict(hicache_storage_backend="file", hicache_storage_url="file://relative"), "hicache_storage_url"),
])
def test_bad_storage_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**ON, **kw)


def test_good_storage_configs_and_one_list_of_backends() -> None:
    assert EngineConfig(**ON).hicache_storage_backend is None
    cfg = EngineConfig(**ON, hicache_storage_backend="file", hicache_storage_url="file:///tmp/kv")
    assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("file", "file:///tmp/kv")
    assert EngineConfig(**ON, hicache_storage_backend="file").hicache_storage_url is None  # the default dir
    assert BACKENDS is HICACHE_STORAGE_BACKENDS


def test_cli_storage_flags_reach_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-url", "file:///tmp/kv"]
    for argv in (["serve", *flags], ["generate", "hi", *flags], ["bench", "offline", *flags]):
        cfg = EngineConfig(**engine_kwargs(parser.parse_args(argv)))
        assert (cfg.hicache_storage_backend, cfg.hicache_storage_url) == ("file", "file:///tmp/kv")
    assert EngineConfig(**engine_kwargs(parser.parse_args(["serve"]))).hicache_storage_backend is None
    assert main(["generate", "hi", "--hicache-storage-backend", "file"]) == 2  # before any model loads
    assert "add --enable-hierarchical-cache" in capsys.readouterr().err
