"""The router's request parser (`requests.parse`) fuzzed with hypothesis: whatever bytes and
headers a client sends to an API path, the parser routes the request or refuses it with a
RouterError (a 4xx with a message), never another exception (a 500).

Bodies come from three generators: arbitrary bytes, arbitrary JSON values, and near-valid
request objects whose fields take arbitrary JSON values; headers mix the ones the parser reads
(the class header, Authorization) with arbitrary text. `SPECGATE_FUZZ_EXAMPLES` sets the
examples a generator and path (default 300); a long run:
`SPECGATE_FUZZ_EXAMPLES=20000 .venv/bin/pytest tests/test_request_fuzz.py`.

Bearer tokens get the same treatment: `oidc.verify` over tokens near a valid one and far from
it (four times `SPECGATE_FUZZ_EXAMPLES`) accepts or answers 401/403, nothing else.
"""

from __future__ import annotations

import base64
import json
import os

import hypothesis
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import strategies as st

from specgate_router import client_auth, oidc, requests
from specgate_router.errors import RouterError
from specgate_router.identity import Client
from specgate_router.settings import ClientKey, OidcSettings, RouterSettings

EXAMPLES = int(os.environ.get("SPECGATE_FUZZ_EXAMPLES", "300"))
SETTINGS = RouterSettings.model_validate(
    {
        "model": "m",
        "backends": ["http://127.0.0.1:9"],
        "engineApiKey": "k",
        "classRules": {"apiKeys": {"sg-batch": "throughput"}, "throughputAboveMaxTokens": 512},
    }
)
KEY = client_auth.from_key(
    ClientKey.model_validate(
        {"name": "tenant", "sha256": client_auth.hash_key("sg-x"), "classes": ["throughput"]}
    )
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    ["model", "messages", "prompt", "text", "input_ids", "sampling_params", "stream",
     "stream_options", "max_tokens", "max_completion_tokens", "max_new_tokens",
     "custom_logit_processor", "lora_path", "return_hidden_states", "temperature"]
)  # fmt: skip
NEAR_VALID = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={"prompt": st.just("hi"), "text": st.just("hi")},
).flatmap(lambda base: st.dictionaries(FIELDS, JSON, max_size=5).map(lambda d: {**base, **d}))
BODIES = {
    "bytes": st.binary(max_size=512),
    "json": JSON.map(lambda v: json.dumps(v).encode()),
    "near-valid": NEAR_VALID.map(lambda v: json.dumps(v).encode()),
}
HEADERS = st.dictionaries(
    st.sampled_from(["x-specgate-class", "authorization", "content-type", "x-other"]),
    st.one_of(st.sampled_from(["latency", "throughput", "Bearer sg-batch", "bulk", ""]), st.text()),
    max_size=3,
)


@pytest.mark.parametrize("path", sorted(requests.PATHS))
@pytest.mark.parametrize("kind", sorted(BODIES))
@pytest.mark.parametrize("client", [None, KEY], ids=["open", "client-key"])
def test_the_parser_routes_or_refuses_whatever_a_client_sends(
    path: str, kind: str, client: Client | None
) -> None:
    outcomes: dict[str, int] = {}

    @hypothesis.given(raw=BODIES[kind], headers=HEADERS)
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def check(raw: bytes, headers: dict[str, str]) -> None:
        try:
            routed = requests.parse(path, raw, headers, SETTINGS, client)
        except RouterError as exc:
            assert 400 <= exc.status < 500, exc
            assert exc.body()["error"]["message"]
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            return
        assert routed.traffic_class in ("latency", "throughput")
        if client is not None:
            assert routed.traffic_class in client.classes
        json.loads(routed.body)  # what goes upstream is JSON
        outcomes["routed"] = outcomes.get("routed", 0) + 1

    check()
    assert outcomes.get("refused", 0) > 0
    if kind == "near-valid":
        assert outcomes.get("routed", 0) > 0, outcomes


# ---- bearer tokens (clientAuth.oidc) ----

OIDC = OidcSettings.model_validate({"issuer": "https://idp.example", "audience": "specgate"})
SIGNER = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RS256 = jwt.algorithms.RSAAlgorithm(jwt.algorithms.RSAAlgorithm.SHA256)
OIDC_KEYS = oidc.parse_jwks(
    {"keys": [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(SIGNER.public_key())),
               "kid": "k1"}]}
)  # fmt: skip
VALID_CLAIMS = {"iss": "https://idp.example", "aud": "specgate", "sub": "u", "exp": 1e10}
CLAIM_NAMES = st.sampled_from(
    ["iss", "aud", "sub", "exp", "nbf", "specgate_classes", "groups", "other"]
)
CLAIMS = st.dictionaries(CLAIM_NAMES, JSON, max_size=3).map(
    lambda changed: {**VALID_CLAIMS, **changed}
) | st.dictionaries(CLAIM_NAMES, JSON, max_size=6)
HEADER = st.dictionaries(st.sampled_from(["alg", "kid", "typ"]), JSON, max_size=2).map(
    lambda changed: {"alg": "RS256", "kid": "k1", **changed}
) | st.fixed_dictionaries(
    {"alg": st.sampled_from(["RS256", "none", "HS256", "ES256", "RS512"])},
    optional={"kid": st.sampled_from(["k1", "k2"])},
)


def _segment(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def test_token_verification_accepts_or_refuses_whatever_a_client_sends() -> None:
    """Tokens near a valid one and far from it (arbitrary header fields and claims), signed
    with the provider's key or not at all: `oidc.verify` returns a client or raises a 401/403
    RouterError, never another exception; a returned client passed every check."""
    outcomes: dict[str, int] = {}

    @hypothesis.given(header=HEADER, claims=CLAIMS, signed=st.booleans())
    @hypothesis.settings(
        max_examples=EXAMPLES * 4,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def check(header: dict[str, object], claims: dict[str, object], signed: bool) -> None:
        body = f"{_segment(header)}.{_segment(claims)}"
        signature = RS256.sign(body.encode(), SIGNER) if signed else b"signature"
        token = body + "." + base64.urlsafe_b64encode(signature).decode().rstrip("=")
        try:
            client = oidc.verify(token, OIDC_KEYS, OIDC, 1_800_000_000.0)
        except RouterError as exc:
            assert exc.status in (401, 403), exc
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            return
        assert signed and header["alg"] == "RS256" and claims["iss"] == "https://idp.example"
        assert isinstance(claims["sub"], str) and claims["sub"]
        assert client.classes and set(client.classes) <= {"latency", "throughput"}
        outcomes["accepted"] = outcomes.get("accepted", 0) + 1

    check()
    assert outcomes.get("refused", 0) > 0 and outcomes.get("accepted", 0) > 0, outcomes
