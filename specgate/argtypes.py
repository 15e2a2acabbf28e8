"""Argument types for every specgate command line: each refuses a bad value in one line naming
the flag and the range (argparse turns it into exit code 2, no traceback)."""

from __future__ import annotations

import argparse
import ipaddress
import math
from collections.abc import Callable


def count(flag: str, low: int, high: int) -> Callable[[str], int]:
    """An integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be {low}-{high}, got {value}")
        return value

    return parse


def port(flag: str) -> Callable[[str], int]:
    return count(flag, 1, 65535)


def positive_float(flag: str) -> Callable[[str], float]:
    """A finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text}")
        return value

    return parse


def host(flag: str) -> Callable[[str], str]:
    """An address to listen on: an IP address or a host name (letters, digits, '-', '.')."""

    def parse(text: str) -> str:
        try:
            ipaddress.ip_address(text)
            return text
        except ValueError:
            pass
        labels = text.split(".")
        if (
            text
            and len(text) <= 253
            and not all(label.isdigit() for label in labels)
            and all(
                label
                and len(label) <= 63
                and label.replace("-", "").isalnum()
                and label.isascii()
                and not label.startswith("-")
                for label in labels
            )
        ):
            return text
        raise argparse.ArgumentTypeError(
            f"{flag} takes an IP address or host name to listen on, got {text!r}"
        )

    return parse


__all__ = ["count", "host", "port", "positive_float"]
