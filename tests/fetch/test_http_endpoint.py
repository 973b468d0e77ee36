"""HttpEndpoint's URLs (bootseer/fetch/sources/http.py): the endpoint of any URL, its origin, its credentials."""

from __future__ import annotations

from urllib.parse import urljoin

import pytest

from bootseer.fetch.source import PermanentError
from bootseer.fetch.sources.http import HttpEndpoint, make_ssl_context


def test_an_ipv6_origin_is_a_url_that_joins_and_splits():
    endpoint = HttpEndpoint("http", "::1", 9870)
    assert endpoint.origin == "http://[::1]:9870"
    # As a redirect's relative Location is resolved against it (the namenode's, a registry's).
    assert urljoin(endpoint.origin + "/webhdfs/v1/f", "/data/f?x=1") == "http://[::1]:9870/data/f?x=1"
    assert HttpEndpoint("https", "store", 443).origin == "https://store:443"


def test_at_keeps_timeouts_and_tls_and_credentials_only_on_their_origin():
    context = make_ssl_context(True, None)
    base = HttpEndpoint("https", "registry", 443, 3.0, 7.0, ssl_context=context).with_headers({"Authorization": "x"})
    same, target = base.at("https://REGISTRY/v2/a/blobs/sha256:1?n=2")
    assert (same.scheme, same.host, same.port, target) == ("https", "registry", 443, "/v2/a/blobs/sha256:1?n=2")
    assert same.headers == {"Authorization": "x"}
    other, target = base.at("http://bucket.example:8080")
    assert (other.scheme, other.host, other.port, target) == ("http", "bucket.example", 8080, "/")
    assert other.headers is None  # another origin never sees the credentials
    assert (other.connect_timeout, other.read_timeout, other.ssl_context) == (3.0, 7.0, context)
    assert base.at("https://registry:443/x")[0].headers == {"Authorization": "x"}  # the default port made explicit


@pytest.mark.parametrize("url", ["ftp://host/x", "file:///etc/passwd", "https:///nohost", "http://host:99999/"])
def test_at_refuses_what_is_not_an_http_url_without_showing_its_secrets(url):
    with pytest.raises(PermanentError) as refused:
        HttpEndpoint("https", "registry", 443).at(url.replace("//", "//user:SECRET@", 1) + "?sig=TOKEN")
    assert "SECRET" not in str(refused.value) and "TOKEN" not in str(refused.value)
