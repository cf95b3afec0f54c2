"""Block header integrity and config loading."""

import pytest

from kvbm.blocks import ALIGNED_HEADER_LEN, BlockKey, decode_block, encode_block, pack_header, unpack_header
from kvbm.config import load_config, parse_size
from kvbm.errors import ConfigError, CorruptBlockError

KEY = BlockKey("model-0123456789abcdef", bytes(range(16)))


def test_block_round_trip_and_header_fields():
    payload = bytes(range(256)) * 100
    body = encode_block(KEY, payload)
    assert bytes(decode_block(KEY, body, expected_len=len(payload))) == payload
    hdr = unpack_header(pack_header(KEY, payload, ALIGNED_HEADER_LEN))
    assert hdr.header_len == 4096 and hdr.payload_len == len(payload) and hdr.hash == KEY.hash
    assert hdr.fingerprint == "0123456789abcdef"


@pytest.mark.parametrize("where", ["payload", "header", "hash"])
def test_any_flipped_byte_is_detected(where):
    payload = b"x" * 4096
    body = bytearray(encode_block(KEY, payload))
    pos = {"payload": 200, "header": 10, "hash": 50}[where]
    body[pos] ^= 0xFF
    with pytest.raises(CorruptBlockError):
        decode_block(KEY, body)


def test_wrong_key_length_or_fingerprint_is_a_mismatch():
    payload = b"y" * 1000
    body = encode_block(KEY, payload)
    with pytest.raises(CorruptBlockError, match="header names block"):
        decode_block(BlockKey(KEY.namespace, b"\x01" * 16), body)
    with pytest.raises(CorruptBlockError, match="fingerprint"):
        decode_block(BlockKey("model-fedcba9876543210", KEY.hash), body)
    with pytest.raises(CorruptBlockError, match="payload is"):
        decode_block(KEY, body[:-1])
    with pytest.raises(CorruptBlockError, match="layout needs"):
        decode_block(KEY, body, expected_len=999)


def test_sizes_parse():
    assert parse_size("8MiB") == 8 << 20 and parse_size("2GB") == 2_000_000_000 and parse_size(4096) == 4096
    with pytest.raises(ConfigError, match=r"host\.capacity"):
        parse_size("lots", "host.capacity")


def test_default_config_and_env_overrides():
    cfg = load_config(environ={})
    assert cfg.block_nbytes == 8 << 20 and cfg.s3.bucket == "kvbm" and cfg.embedded_s3.enabled
    env = {"KVBM_S3_ENDPOINT": "http://127.0.0.1:9000", "KVBM_S3_BUCKET": "kvcache", "KVBM_DISK_DIR": "/nvme/kv",
           "KVBM_S3_MAX_CONCURRENCY": "16", "KVBM_DISK_FSYNC": "off", "KVBM_BLOCK_BYTES": "4MiB",
           "KVBM_DAEMON_VLLM_EVENTS": "tcp://127.0.0.1:1,tcp://127.0.0.1:2"}
    cfg = load_config(environ=env)
    assert cfg.s3.endpoint == "http://127.0.0.1:9000" and cfg.s3.bucket == "kvcache"
    assert str(cfg.disk_dir) == "/nvme/kv" and cfg.s3.max_concurrency == 16 and cfg.disk.fsync is False
    assert cfg.block_nbytes == 4 << 20 and len(cfg.daemon.vllm_events) == 2


@pytest.mark.parametrize(
    "text,field",
    [("s3:\n  max_concurrency: many\n", "s3.max_concurrency"), ("disk:\n  bogus: 1\n", "disk"),
     ("s3:\n  bucket: ab\n", "s3.bucket"), ("host:\n  capacity: huge\n", "host.capacity"),
     ("s3:\n  client: ftp\n", "s3.client")],
)
def test_bad_config_names_the_field(tmp_path, text, field):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(p, environ={})


@pytest.mark.parametrize("port", [55536, 56883, 65535, 70000, -1])
def test_embedded_s3_port_whose_grpc_port_is_out_of_range_is_refused_at_load(port):
    """SeaweedFS listens on port + 10000 for gRPC: above 55535 that is no port, which the start reported
    only as 'port 56883 (or its gRPC port 66883) is in use'."""
    from kvbm.s3server import EmbeddedS3

    with pytest.raises(ConfigError, match=r"embedded_s3\.port: .* 0 \(any free port\) or 1-55535") as ei:
        load_config(environ={"KVBM_EMBEDDED_S3_PORT": str(port)})
    if port > 55535:
        assert f"gRPC port {port + 10000}" in str(ei.value)
    with pytest.raises(ConfigError, match=r"port: .* 1-55535"):  # the class the CLI and tests start directly
        EmbeddedS3("/nonexistent", port=port)
    assert load_config(environ={"KVBM_EMBEDDED_S3_PORT": "55535"}).embedded_s3.port == 55535


def test_sizes_are_bytes_once_the_config_is_built(tmp_path):
    """Every size field is parsed once, where its section is built (YAML, env or in code), so no consumer
    parses a size again (before: 17 call sites of parse_size, each naming its field)."""
    from kvbm.config import DiskConfig, S3Config

    f = tmp_path / "c.yaml"
    f.write_text("block_bytes: 4MiB\nhost:\n  capacity: 2GB\n")
    cfg = load_config(f, environ={"KVBM_DISK_CAPACITY": "3GiB", "KVBM_DEVICE_CAPACITY": "4096"})
    got = (cfg.block_bytes, cfg.host.capacity, cfg.disk.capacity, cfg.device.capacity, cfg.s3.capacity)
    assert got == (4 << 20, 2 * 10**9, 3 << 30, 4096, 1 << 40) and all(type(v) is int for v in got)
    assert DiskConfig(capacity="1KiB").capacity == 1024 and S3Config().capacity == 1 << 40
    f.write_text("disk:\n  capacity: -5\n")
    with pytest.raises(ConfigError, match=r"disk\.capacity: must be >= 0"):
        load_config(f, environ={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="KVBM_S3_MAX_CONCURRENCY"):
        load_config(environ={"KVBM_S3_MAX_CONCURRENCY": "x"})


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_every_shipped_config_loads():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 2
    for path in configs:
        cfg = load_config(path, environ={})
        assert cfg.block_nbytes > 0, path
    remote = load_config(Path(__file__).parents[2] / "configs" / "remote-s3.yaml", environ={})
    assert remote.s3.endpoint.startswith("https://") and not remote.embedded_s3.enabled
