"""Credentials masked out of URLs: database URLs as SQLAlchemy reads them, HTTP URLs (userinfo,
secret query parameters, webhook tokens in the path), any text, and log records."""

from __future__ import annotations

import io
import logging
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from foundation.redact import MASK, RedactFilter, redact_text, redact_url, url_secrets


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://rw:s3cret@db:5432/retrywatch", "postgresql+psycopg://rw:***@db:5432/retrywatch"),
        ("postgresql://rw:p%40ss@db/x?sslmode=require", "postgresql://rw:***@db/x?sslmode=require"),
        ("postgresql://rw@db/x?password=s3cret&sslmode=require", "postgresql://rw@db/x?password=***&sslmode=require"),
        ("postgresql://rw:pa/ss?x@db/x", "postgresql://rw:***@db/x"),  # unencoded, as make_url reads it
        ("rw:s3cret@db/x", "rw:***@db/x"),  # no scheme: still a password
        ("sqlite:////var/lib/retrywatch/detector.db", "sqlite:////var/lib/retrywatch/detector.db"),
        ("sqlite:///relative.db", "sqlite:///relative.db"),
        ("http://prom.example:9090", "http://prom.example:9090"),
        ("https://user:s3cret@prom.example/api", "https://user:***@prom.example/api"),
        ("https://u:p@ss@am.example/", "https://u:***@am.example/"),
        ("https://APITOKEN@sentry.example/1", "https://***@sentry.example/1"),
        ("https://hooks.slack.com/services/T00/B00/XXXX", "https://hooks.slack.com/services/***"),
        ("https://discord.com/api/webhooks/123/tok-en", "https://discord.com/api/webhooks/***"),
        ("https://x.webhook.office.com/webhookb2/abc@def/IncomingWebhook/1/2",
         "https://x.webhook.office.com/webhookb2/***"),
        ("https://mm.example/hooks/xyz?channel=ops", "https://mm.example/hooks/***?channel=ops"),
        ("https://chat.example/v1/spaces/A/messages?key=K1&token=T2", "https://chat.example/v1/spaces/A/messages?key=***&token=***"),
        ("https://receiver.example/services/alerts", "https://receiver.example/services/alerts"),
        ("http://h/x?api_key=&a=b", "http://h/x?api_key=&a=b"),
        ("http://[::1", "http://[::1"),  # malformed: never raises
        ("", ""),
    ],
)  # fmt: skip
def test_redact_url(url: str, masked: str) -> None:
    assert redact_url(url) == masked
    assert redact_url(masked) == masked  # masking twice changes nothing


@given(
    st.text(st.characters(blacklist_characters="@", blacklist_categories=("Cs",)), min_size=1, max_size=40)
)
def test_a_database_password_is_masked_however_it_is_written(password: str) -> None:
    url = f"postgresql+psycopg://rw:{password}@db.example:5432/x"
    assert make_url(url).password == unquote(password)  # SQLAlchemy reads it so ...
    assert redact_url(url) == "postgresql+psycopg://rw:***@db.example:5432/x"  # ... and so is it masked
    assert password in url_secrets(url)


def test_redact_text_masks_urls_and_their_secrets_anywhere() -> None:
    db = "postgresql://rw:p%40ssword@db/x"
    hook = "https://hooks.example/hooks/TOKEN123?token=QTOKEN"
    text = f"failed: {db} ({'p@ssword'}) then POST {hook}; token QTOKEN; short :ab@ stays ab"
    out = redact_text(text, [db, hook, None, "http://u:ab@h/"])
    assert out == (
        "failed: postgresql://rw:***@db/x (***) then POST https://hooks.example/hooks/***?token=***;"
        " token ***; short :***@ stays ab"
    )


def test_the_log_filter_masks_messages_arguments_and_tracebacks() -> None:
    url = "postgresql://rw:s3cretpw@db/x"
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactFilter([url, None]))
    logger = logging.getLogger("tests.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("connecting to %s", url)
        try:
            raise ConnectionError(f"cannot reach {url}")
        except ConnectionError:
            logger.exception("failed with s3cretpw")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "s3cretpw" not in out
    assert out.count(f"rw:{MASK}@db/x") == 2 and "ConnectionError" in out
