"""Deterministic prompt material: token ids from a seeded generator, lengths from a spec string,
and the same ids rendered as word text for servers that take text.

Every generator takes its own numpy Generator (or a seed tuple), so a workload is a pure
function of its config and seed.
"""
from __future__ import annotations

import re

import numpy as np

from loadtest.types import Content

FIRST_ID = 16  # leave low ids (special tokens in most tokenizers) out of random prompts

# Common short English words: each is usually one token with a leading space in BPE vocabularies,
# so a text prompt of N words is close to N tokens.
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three small house away again place light water left thought city game line"
).split()


def rng_for(*key: int) -> np.random.Generator:
    """A generator named by integers (seed, block id, ...): the same key gives the same stream."""
    return np.random.default_rng([abs(int(k)) for k in key])


def random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab_size, size=n).tolist()


def as_text(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def render(ids: list[int], prompt_format: str) -> Content:
    """`ids` as the workload's prompt format: the ids themselves, or deterministic word text."""
    return ids if prompt_format == "ids" else as_text(ids)


_UNIFORM = re.compile(r"(\d+):(\d+)")
_NORMAL = re.compile(r"normal:(\d+(?:\.\d*)?),(\d+(?:\.\d*)?)")


def check_lengths(spec: str) -> str:
    """The spec if it is valid, else ValueError saying the accepted forms."""
    spec = spec.strip()
    if re.fullmatch(r"\d+", spec) and int(spec) > 0:
        return spec
    m = _UNIFORM.fullmatch(spec)
    if m and 0 < int(m[1]) <= int(m[2]):
        return spec
    if _NORMAL.fullmatch(spec) or re.fullmatch(r"\d+(,\d+)+", spec) and "0" not in spec.split(","):
        return spec
    raise ValueError(f"bad length {spec!r}: use N (fixed), LO:HI (uniform, inclusive), normal:MEAN,STD "
                     "or a list A,B,C to sample from; every length >= 1")


def sample_lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    """n lengths drawn from `spec` (see check_lengths); always >= 1."""
    spec = check_lengths(spec)
    if spec.isdigit():
        return [int(spec)] * n
    if m := _UNIFORM.fullmatch(spec):
        return rng.integers(int(m[1]), int(m[2]) + 1, size=n).tolist()
    if m := _NORMAL.fullmatch(spec):
        return np.maximum(1, np.rint(rng.normal(float(m[1]), float(m[2]), size=n))).astype(int).tolist()
    choices = [int(x) for x in spec.split(",")]
    return rng.choice(choices, size=n).tolist()
