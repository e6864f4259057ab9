"""Bearer tokens: file and env sources, tenants, refusals."""
import pytest

from router.auth import DEFAULT_TENANT, Authenticator, AuthSetupError
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
    assert auth.tenant(f"bearer {TOKEN_B}") == DEFAULT_TENANT
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
    from router.auth import cache_salt

    assert cache_salt(DEFAULT_TENANT) is None  # auth off: the documented, unsalted hash chain
    assert cache_salt(DEFAULT_TENANT, "conv") == "default:conv"
    assert cache_salt("acme") == "acme" and cache_salt("acme", "conv") == "acme:conv"
    f = tmp_path / "tokens"
    f.write_text(f"default:conv {TOKEN_A}\n")  # would collide with the default tenant's salted requests
    with pytest.raises(AuthSetupError, match="':'"):
        Authenticator.from_config(AuthConfig(token_file=str(f)))
