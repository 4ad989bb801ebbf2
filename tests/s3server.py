"""An S3 server on 127.0.0.1 for tests: moto's, in a thread, with the credentials it takes."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

import boto3
from moto.server import ThreadedMotoServer

CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """A running server's endpoint URL, stopped on exit."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.stop()


def s3_client(endpoint: str):
    """A boto3 S3 client of the server at ``endpoint``."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDS["AWS_DEFAULT_REGION"],
    )
