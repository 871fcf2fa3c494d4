"""A shared KV tier's URL is checked when the settings are read, before a model loads (one line, not a traceback)."""

from __future__ import annotations

import pytest

from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.redis_source import check_tier_url, tier_unreachable


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379", "redis://h:1/0", "rediss://user:pw@host:6380/2",
                                 "unix:///tmp/redis.sock"])
def test_good_tier_urls_pass(url):
    assert check_tier_url(url) == url


@pytest.mark.parametrize(("url", "why"), [("redis://127.0.0.1:99999", "not a valid URL"),
                                          ("redis://[::bad", "not a valid URL"), ("redis://:6379", "no host"),
                                          ("redis://h:6379/x", "database is a number"),
                                          ("unix://", "no socket path"), ("http://h:1", "expected redis://")])
def test_bad_tier_urls_are_one_line(url, why):
    with pytest.raises(FusionRAGError, match=why):
        check_tier_url(url)


def test_the_server_refuses_a_bad_tier_before_loading_anything(capsys, tmp_path):
    from fusionrag.cli import main

    assert main(["serve", "--store", str(tmp_path), "--kv-tier", "redis://127.0.0.1:99999"]) == 2
    err = capsys.readouterr().err
    assert "not a valid URL" in err and "Traceback" not in err and err.count("\n") == 1


def test_an_unreachable_tier_is_named():
    why = tier_unreachable("redis://127.0.0.1:9", timeout_s=0.5)  # the discard port: nothing listens
    assert why and "Error" in why
