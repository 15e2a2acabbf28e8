"""What identifying a client costs the router, per request, in one process side by side:
`ClientAuth.identify` for an API key (the ring holding --keys entries, each compared in
constant time), an RS256 token (2048-bit key) and an ES256 token (P-256) at first use (the
signature checked) and an RS256 token again (remembered), with the provider's keys held (no
fetch in the loop). Alternated rounds of --calls calls each; the median time per call, and
its ratio to the API key's.

    .venv/bin/python lab/bench/auth_cost.py [--calls 2000] [--rounds 7] [--keys 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1] / p) for p in ("", "router")]

import jwt  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, rsa  # noqa: E402

from specgate_router import client_auth, oidc  # noqa: E402
from specgate_router.settings import ClientAuthSettings  # noqa: E402

ISSUER = "https://idp.example"


def _jwk(public: Any, algorithm: Any, kid: str) -> dict[str, Any]:
    return {**json.loads(algorithm.to_jwk(public)), "kid": kid}


def build(keys: int) -> tuple[client_auth.ClientAuth, dict[str, str]]:
    """A ClientAuth with `keys` API keys and an OIDC provider holding an RSA and an EC key,
    and one Authorization header per kind."""
    ring = [{"name": f"k{i}", "sha256": client_auth.hash_key(f"sg-key-{i}")} for i in range(keys)]
    settings = ClientAuthSettings.model_validate(
        {"keys": ring, "oidc": {"issuer": ISSUER, "audience": "specgate"}}
    )
    auth = client_auth.ClientAuth(settings)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    assert auth.tokens is not None
    auth.tokens.keys = oidc.parse_jwks(
        {
            "keys": [
                _jwk(rsa_key.public_key(), jwt.algorithms.RSAAlgorithm, "r"),
                _jwk(ec_key.public_key(), jwt.algorithms.ECAlgorithm, "e"),
            ]
        }
    )
    auth.tokens._fetched_at = 0.0  # held: no refresh during the loop
    claims = {"iss": ISSUER, "aud": "specgate", "sub": "bench", "exp": time.time() + 3600}
    rs256 = "Bearer " + jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": "r"})
    headers = {
        "API key": f"Bearer sg-key-{keys - 1}",  # the last entry: every hash compared anyway
        "RS256 token, first use": rs256,
        "ES256 token, first use": "Bearer "
        + jwt.encode(claims, ec_key, algorithm="ES256", headers={"kid": "e"}),
        "RS256 token, again": rs256,
    }
    return auth, headers


async def per_call_us(
    auth: client_auth.ClientAuth, header: str, calls: int, first_use: bool
) -> float:
    assert auth.tokens is not None
    remembered = auth.tokens._verified
    start = time.perf_counter()
    for _ in range(calls):
        if first_use:
            remembered.clear()
        await auth.identify(header, 1.0)
    return (time.perf_counter() - start) / calls * 1e6


async def run(args: argparse.Namespace) -> dict[str, Any]:
    auth, headers = build(args.keys)
    for header in headers.values():  # each accepted before timing
        await auth.identify(header, 1.0)
    rounds: dict[str, list[float]] = {name: [] for name in headers}
    for i in range(args.rounds):
        for name, header in headers.items():
            first_use = name.endswith("first use")
            rounds[name].append(round(await per_call_us(auth, header, args.calls, first_use), 1))
        print(f"round {i + 1}/{args.rounds}: {rounds}", file=sys.stderr)
    median = {name: statistics.median(v) for name, v in rounds.items()}
    return {"calls": args.calls, "keys": args.keys, "us_per_call": rounds, "median_us": median}


def report(results: dict[str, Any]) -> str:
    base = results["median_us"]["API key"]
    lines = [
        f"| client identified by | per call, median of {len(results['us_per_call']['API key'])}"
        " rounds | / API key |",
        "| --- | --- | --- |",
    ]
    for name, us in results["median_us"].items():
        lines.append(f"| {name} | {us:.1f} us | {us / base:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    text = report(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "auth_cost.json").write_text(json.dumps(results, indent=1))
        (args.out / "auth_cost.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
