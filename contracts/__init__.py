"""Wire contracts shared by more than one part of Umbra (`umbra.contracts`).

A record, header or document that one part emits and another parses is defined here once and
imported by both sides, so a limit or field can never differ between the two ends of a wire.
This package is a leaf: it imports nothing of Umbra's (tests/test_layering.py), so every part,
`umbra.attest` included, can use it.
"""
