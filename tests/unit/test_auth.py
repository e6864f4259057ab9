"""Bearer tokens: file and env sources, tenants, refusals."""
import pytest

from router.auth import DEFAULT_TENANT, Authenticator, AuthSetupError, anonymous_tenant, cache_salt
from router.config import AuthConfig

TOKEN_A = "a" * 20
TOKEN_B = "b-token-0123456789"


def test_off_by_default_everyone_is_default_tenant():
    auth = Authenticator.from_config(AuthConfig())
    assert not auth.enabled and auth.tenant(None) == DEFAULT_TENANT


def test_file_and_env_tokens(tmp_path, monkeypatch):
    f = tmp_path / "tokens"
    f.write_text(f"# team tokens\nacme {TOKEN_A}\n\n")
    monkeypatch.setenv("BRIGADE_TEST_TOKENS", TOKEN_B)
    auth = Authenticator.from_config(AuthConfig(token_file=str(f), token_env="BRIGADE_TEST_TOKENS"))
    assert auth.tenant(f"Bearer {TOKEN_A}") == "acme"
    assert auth.tenant(f"bearer {TOKEN_B}") == anonymous_tenant(TOKEN_B)
    for bad in (None, "", TOKEN_A, f"Basic {TOKEN_A}", f"Bearer {TOKEN_A}x", "Bearer ", f"Bearer {TOKEN_A[:-1]}"):
        assert auth.tenant(bad) is None, bad


@pytest.mark.parametrize("content, match", [
    ("short\n", "at least 16"), ("a b c\n", "3 fields"), ("# nothing\n", "no token"),
])
def test_bad_token_file(tmp_path, content, match):
    f = tmp_path / "tokens"
    f.write_text(content)
    with pytest.raises(AuthSetupError, match=match):
        Authenticator.from_config(AuthConfig(token_file=str(f)))


def test_missing_sources(tmp_path, monkeypatch):
    with pytest.raises(AuthSetupError, match="token_file"):
        Authenticator.from_config(AuthConfig(token_file=str(tmp_path / "absent")))
    monkeypatch.delenv("BRIGADE_TEST_UNSET", raising=False)
    with pytest.raises(AuthSetupError, match="BRIGADE_TEST_UNSET"):
        Authenticator.from_config(AuthConfig(token_env="BRIGADE_TEST_UNSET"))


def test_cache_salt_rule(tmp_path):
    assert cache_salt(DEFAULT_TENANT) is None  # auth off: the documented, unsalted hash chain
    assert cache_salt(DEFAULT_TENANT, "conv") == "default:conv"
    assert cache_salt("acme") == "acme" and cache_salt("acme", "conv") == "acme:conv"
    f = tmp_path / "tokens"
    f.write_text(f"default:conv {TOKEN_A}\n")  # would collide with the default tenant's salted requests
    with pytest.raises(AuthSetupError, match="':'"):
        Authenticator.from_config(AuthConfig(token_file=str(f)))


def test_tokens_listed_without_a_tenant_are_each_their_own_tenant(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    auth = Authenticator.from_config(AuthConfig(token_file=str(f)))
    a, b = auth.tenant(f"Bearer {TOKEN_A}"), auth.tenant(f"Bearer {TOKEN_B}")
    assert a != b and DEFAULT_TENANT not in (a, b)
    assert cache_salt(a) != cache_salt(b) and None not in (cache_salt(a), cache_salt(b))  # no shared prefix cache
    assert TOKEN_A not in a and ":" not in a


@pytest.mark.parametrize("file, env", [
    (f"{TOKEN_A}\nacme {TOKEN_A}\n", None),  # twice in the file
    (f"acme {TOKEN_A}\n", f"{TOKEN_B},{TOKEN_A}"),  # in the file and the variable
    (None, f"{TOKEN_B},zeta {TOKEN_B}"),
])
def test_a_token_listed_twice_is_a_start_up_error(tmp_path, monkeypatch, file, env):
    cfg = {}
    if file is not None:
        (tmp_path / "tokens").write_text(file)
        cfg["token_file"] = str(tmp_path / "tokens")
    if env is not None:
        monkeypatch.setenv("BRIGADE_TEST_TOKENS", env)
        cfg["token_env"] = "BRIGADE_TEST_TOKENS"
    with pytest.raises(AuthSetupError, match="listed") as err:
        Authenticator.from_config(AuthConfig(**cfg))
    assert TOKEN_A not in str(err.value) and TOKEN_B not in str(err.value)


SCRAPED = AuthConfig(token_env="BRIGADE_TEST_TOKENS", metrics_token_env="BRIGADE_TEST_METRICS")


def test_a_metrics_only_token_reads_metrics_and_nothing_else(monkeypatch):
    scraper = "scrape-token-0123456789"
    monkeypatch.setenv("BRIGADE_TEST_TOKENS", TOKEN_A)
    monkeypatch.setenv("BRIGADE_TEST_METRICS", scraper)
    auth = Authenticator.from_config(SCRAPED)
    assert auth.may_scrape(f"Bearer {scraper}") and auth.tenant(f"Bearer {scraper}") is None
    assert auth.may_scrape(f"Bearer {TOKEN_A}") and auth.tenant(f"Bearer {TOKEN_A}") is not None
    assert not auth.may_scrape(None) and not auth.may_scrape("Bearer not-a-known-token-0000")
    monkeypatch.setenv("BRIGADE_TEST_METRICS", TOKEN_A)  # an API token again, as a scraper's
    with pytest.raises(AuthSetupError, match="listed"):
        Authenticator.from_config(SCRAPED)
    with pytest.raises(AuthSetupError, match="needs auth.token_file or auth.token_env"):
        Authenticator.from_config(AuthConfig(metrics_token_env="BRIGADE_TEST_METRICS"))
    monkeypatch.delenv("BRIGADE_TEST_METRICS")  # unset: no scraper, the API tokens still work
    auth = Authenticator.from_config(SCRAPED)
    assert auth.may_scrape(f"Bearer {TOKEN_A}") and not auth.may_scrape(f"Bearer {scraper}")
