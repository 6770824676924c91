"""Settings: validation on construction and the one environment reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nccl_back.config import RETIRED, Settings
from nccl_back.errors import ConfigError, NcclBackError


def test_defaults_are_valid() -> None:
    """Default settings construct and follow the design's handshake timeouts."""
    s = Settings()
    assert s.sender_handshake == 1.0
    assert s.handshake_timeout == 10.0
    assert s.heartbeat_interval == pytest.approx(s.peer_ttl / 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"redis_url": "http://x:1"}, r"redis_url='http://x:1': scheme must be redis://"),
        ({"redis_url": "redis://:6379"}, r"no host"),
        ({"redis_url": "redis://h:notaport"}, r"bad port"),
        ({"namespace": "a b"}, r"namespace='a b'"),
        ({"transport": "mpi"}, r"transport='mpi': choose auto, gloo or nccl"),
        ({"verify": "maybe"}, r"verify='maybe'"),
        ({"transfer_timeout": 0}, r"transfer_timeout=0: must be a positive number"),
        ({"max_concurrent_sends": 0}, r"max_concurrent_sends=0: must be a positive integer"),
        ({"bucket_bytes": True}, r"bucket_bytes=True"),
        ({"bucket_bytes": -1}, r"bucket_bytes=-1: must be 0 \(automatic/unlimited\) or positive"),
        ({"max_send_gbps": -0.5}, r"max_send_gbps=-0.5: must be 0"),
        ({"cohort_max_size": -1}, r"cohort_max_size=-1: must be 0 \(automatic/unlimited\) or positive"),
        ({"cohort_window": 0}, r"cohort_window=0: must be a positive number"),
        ({"stall_timeout": -1}, r"stall_timeout=-1: must be a positive number"),
        ({"handshake_timeout": 0}, r"handshake_timeout=0: must be a positive number"),
        ({"cooperative_download": 0}, r"cooperative_download=0: must be true or false"),
    ],
)
def test_bad_values_name_the_value(kwargs: dict[str, object], message: str) -> None:
    """Each bad field raises ConfigError naming the field and value."""
    with pytest.raises(ConfigError, match=message):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_config_error_is_in_hierarchy() -> None:
    """ConfigError is both an NcclBackError and a ValueError."""
    assert issubclass(ConfigError, NcclBackError)
    assert issubclass(ConfigError, ValueError)


def test_from_env_reads_prefixed_variables() -> None:
    """from_env parses NCCL_BACK_* into typed fields; '0' and 'false' are values, not unset."""
    env = {
        "NCCL_BACK_REDIS_URL": "rediss://:pw@redis.example:6380/1",
        "NCCL_BACK_NAMESPACE": "fleet",
        "NCCL_BACK_TRANSFER_TIMEOUT": "30",
        "NCCL_BACK_MAX_CONCURRENT_SENDS": "2",
        "NCCL_BACK_STRICT": "false",
        "UNRELATED": "x",
    }
    s = Settings.from_env(env)
    assert s.redis_url == "rediss://:pw@redis.example:6380/1"
    assert s.namespace == "fleet"
    assert s.transfer_timeout == 30.0
    assert s.max_concurrent_sends == 2
    assert s.strict is False
    assert Settings.from_env({"NCCL_BACK_STRICT": "1"}).strict is True


def test_from_env_overrides_win() -> None:
    """Keyword overrides take precedence over the environment."""
    s = Settings.from_env({"NCCL_BACK_NAMESPACE": "env"}, namespace="kw")
    assert s.namespace == "kw"


def test_from_env_bad_number_names_variable() -> None:
    """An unparsable number names the variable and its value."""
    with pytest.raises(ConfigError, match=r"NCCL_BACK_PEER_TTL='soon'"):
        Settings.from_env({"NCCL_BACK_PEER_TTL": "soon"})
    with pytest.raises(ConfigError, match=r"NCCL_BACK_STRICT='perhaps'"):
        Settings.from_env({"NCCL_BACK_STRICT": "perhaps"})


def test_settings_are_frozen() -> None:
    """Settings cannot be mutated after construction; replace() validates again."""
    s = Settings()
    with pytest.raises(AttributeError):
        s.namespace = "x"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="peer_ttl=-1"):
        s.replace(peer_ttl=-1)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_nan_and_infinite_values_are_rejected(value: str) -> None:
    """NaN or infinite seconds (from the environment or code) are a ConfigError."""
    with pytest.raises(ConfigError, match=r"NCCL_BACK_|transfer_timeout=(nan|inf|-inf)"):
        Settings.from_env({"NCCL_BACK_TRANSFER_TIMEOUT": value})
    with pytest.raises(ConfigError, match=r"stall_timeout=(nan|inf|-inf): must be"):
        Settings(stall_timeout=float(value))


def test_secret_from_variable_or_file_never_shown(tmp_path: Path) -> None:
    """The secret comes from NCCL_BACK_SECRET or a file (newline dropped), never in repr."""
    secret = "s3cret-" + "x" * 20
    assert Settings.from_env({"NCCL_BACK_SECRET": secret}).secret == secret
    path = Path(str(tmp_path)) / "secret"
    path.write_text(secret + "\n")
    s = Settings.from_env({"NCCL_BACK_SECRET_FILE": str(path)})
    assert s.secret == secret
    assert secret not in repr(s)
    assert Settings().secret is None and Settings().key("sign") is None
    keys = {s.key("sign"), s.key("samples"), Settings(secret=secret + "!").key("sign")}
    assert len(keys) == 3 and all(k is not None and len(k) == 32 for k in keys)


def test_bad_secrets_are_config_errors_without_the_value(tmp_path: Path) -> None:
    """Short secrets, unreadable files and both sources set are errors naming no secret."""
    with pytest.raises(ConfigError, match="at least 16 bytes") as info:
        Settings(secret="short")
    assert "short" not in str(info.value)
    with pytest.raises(ConfigError, match=r"NCCL_BACK_SECRET_FILE='/nonexistent/s': cannot read"):
        Settings.from_env({"NCCL_BACK_SECRET_FILE": "/nonexistent/s"})
    path = Path(str(tmp_path)) / "secret"
    path.write_text("y" * 32)
    with pytest.raises(ConfigError, match="both set"):
        Settings.from_env({"NCCL_BACK_SECRET_FILE": str(path), "NCCL_BACK_SECRET": "z" * 32})
    path.write_bytes(b"\xff" * 32)
    with pytest.raises(ConfigError, match="not UTF-8"):
        Settings.from_env({"NCCL_BACK_SECRET_FILE": str(path)})


def test_derived_bounds_keep_the_defaults_of_the_settings_they_replace() -> None:
    """Each derived bound follows its field and, at the defaults, equals the retired setting's default."""
    s = Settings()
    assert (s.sender_handshake, s.connect_timeout, s.busy_wait, s.artifact_wait) == (1.0, 11.0, 60.0, 60.0)
    assert (s.single_flight_wait, s.single_flight_max_wait, s.peer_budget) == (300.0, 3600.0, 210.0)
    assert (s.claim_ttl, s.download_lease, s.download_group_window) == (6.0, 15.0, 0.2)
    assert s.peer_budget == s.busy_wait + s.transfer_timeout + 3 * s.handshake_timeout
    assert Settings(transfer_timeout=5.0).connect_timeout == 5.0
    assert Settings(peer_ttl=5.0).claim_ttl == 3.0
    assert Settings(cohort_window=3.0).download_group_window == pytest.approx(0.3)
    assert Settings(cooperative_download=False).download_group_window == 0.0


def test_capped_lowers_a_derived_bound_and_survives_replace() -> None:
    """capped() carves a derived bound shorter (never longer), keeps it through replace(), and
    refuses a name that is not a derived bound or a bad number."""
    s = Settings().capped(peer_budget=3.0, busy_wait=100.0)
    assert (s.peer_budget, s.busy_wait) == (3.0, 60.0)
    assert s.replace(namespace="other").peer_budget == 3.0
    assert s.caps == {"peer_budget": 3.0, "busy_wait": 100.0} and Settings().caps == {}
    with pytest.raises(ConfigError, match="transfer_timeout: not a derived bound"):
        Settings().capped(transfer_timeout=1.0)
    with pytest.raises(ConfigError, match="claim_ttl=0: must be a positive number"):
        Settings().capped(claim_ttl=0)


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_setting_is_an_error_naming_its_replacement(name: str) -> None:
    """A retired setting, as a keyword, in replace() or as NCCL_BACK_*, is one ConfigError naming
    what replaces it; never silently ignored."""
    with pytest.raises(ConfigError, match=rf"^{name}: setting retired; {re.escape(RETIRED[name])}$"):
        Settings(**{name: 1.0})
    with pytest.raises(ConfigError, match=rf"^{name}: setting retired"):
        Settings().replace(**{name: 1.0})
    env = f"NCCL_BACK_{name.upper()}"
    with pytest.raises(ConfigError, match=rf"^{env}: setting retired; {re.escape(RETIRED[name])}$"):
        Settings.from_env({env: "1"})


def test_bucket_policy_per_transport_and_send_cap_from_env() -> None:
    """bucket_bytes=0 picks the bucket per transport and model size; an explicit value wins; the send cap
    and cohort settings come from NCCL_BACK_* variables."""
    auto = Settings()
    assert (auto.bucket_for("gloo"), auto.bucket_for("nccl")) == (1 << 20, 8 << 20)
    # gloo: about 1/64 of the model, a power of two from 1 to 8 MiB.
    assert [auto.bucket_for("gloo", mb << 20) for mb in (32, 64, 128, 300, 1024, 8192)] == [
        1 << 20, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 8 << 20]
    assert auto.bucket_for("nccl", 1 << 30) == 8 << 20
    assert Settings(bucket_bytes=4096).bucket_for("nccl") == 4096
    s = Settings.from_env({"NCCL_BACK_MAX_SEND_GBPS": "2.5", "NCCL_BACK_COHORT_MAX_SIZE": "4",
                           "NCCL_BACK_COHORT_WINDOW": "0.5"})
    assert (s.max_send_gbps, s.cohort_max_size, s.cohort_window) == (2.5, 4, 0.5)
    assert Settings().max_send_gbps == 0.0


def test_the_cohort_size_is_the_trees_own_unless_set() -> None:
    """cohort_max_size 0 (the default) takes 1,024 seats in the trees; a size set wins."""
    assert Settings().cohort_limit == 1024
    assert Settings(cohort_max_size=8).cohort_limit == 8
    assert Settings(cohort_max_size=1).cohort_limit == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCL_BACK_TRANSFER_TIMEOUT": "0"}, r"^transfer_timeout=0\.0: must be .* \(from NCCL_BACK_TRANSFER_TIMEOUT\)$"),
        ({"NCCL_BACK_REDIS_URL": "redis://["}, r"^redis_url='redis://\[': Invalid IPv6 URL .* \(from NCCL_BACK_REDIS_URL\)$"),
        ({"NCCL_BACK_REDIS_URL": "redis://h:²"}, r"^redis_url='redis://h:²': bad port .* \(from NCCL_BACK_REDIS_URL\)$"),
        ({"NCCL_BACK_REDIS_URL": "redis://h/²"}, r"the database must be a number"),
        ({"NCCL_BACK_REDIS_URL": "redis://h\t:1/0"}, r"whitespace or control characters"),
        ({"NCCL_BACK_NAMESPACE": "\udc80"}, r"^namespace='\\udc80': not UTF-8 text \(from NCCL_BACK_NAMESPACE\)$"),
        ({"NCCL_BACK_SECRET": "x" * 20 + "\udc80"}, r"^secret: not UTF-8 text \(from NCCL_BACK_SECRET\)$"),
        ({"NCCL_BACK_SECRET_FILE": "a\x00b"}, r"^NCCL_BACK_SECRET_FILE='a\\x00b': not a file path"),
    ],
)
def test_from_env_errors_name_the_variable(env: dict[str, str], message: str) -> None:
    """Values that passed parsing but fail validation, undecodable bytes (lone surrogates
    in os.environ) and odd URLs are ConfigErrors naming the variable, never a ValueError
    or UnicodeEncodeError (cases tests/test_parsers_props.py generates)."""
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"redis_url": True}, r"redis_url=True: must be a string"),
        ({"namespace": ["a"]}, r"namespace=\['a'\]: must be a string"),
        ({"strict": "yes"}, r"strict='yes': must be true or false"),
        ({"cache_dir": None}, r"cache_dir=None: must be a string"),
    ],
)
def test_wrongly_typed_values_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    """A value of the wrong JSON type (vLLM's extra config) is a ConfigError naming the
    field, not an AttributeError or TypeError from deeper down."""
    with pytest.raises(ConfigError, match=message):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_a_retired_key_of_an_engines_extra_config_names_its_replacement() -> None:
    """vLLM's model_loader_extra_config with a retired key: one ConfigError naming the key and its replacement."""
    from nccl_back.engines.common import settings_from

    with pytest.raises(ConfigError, match=r"^model_loader_extra_config\['relay_stall_timeout'\]: setting retired;"
                                          r" set stall_timeout"):
        settings_from({"relay_stall_timeout": 3})
    assert settings_from({"stall_timeout": 3}).stall_timeout == 3.0
