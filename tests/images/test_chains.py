"""ChainIDs, and the label ``bootseer rpull`` puts on a layer's Prepare naming the layers above it."""

from __future__ import annotations

import hashlib

from bootseer.images.chains import (
    LABEL_LAYERS_ABOVE,
    MAX_LABEL_BYTES,
    MAX_LAYERS_ABOVE,
    chain_id,
    chain_ids,
    layers_above,
    layers_above_label,
)


def diff(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def test_each_prepare_names_the_layers_above_it_lowest_first_and_the_top_none() -> None:
    chain = chain_ids([diff(n) for n in range(4)])
    assert chain[1] == chain_id(chain[0], diff(1))
    assert layers_above_label(chain, 0) == ",".join(chain[1:])
    assert layers_above_label(chain, 2) == chain[3]
    assert layers_above_label(chain, 3) == ""
    assert layers_above({LABEL_LAYERS_ABOVE: layers_above_label(chain, 0)}) == chain[1:]


def test_a_deep_image_names_as_many_as_one_label_holds() -> None:
    chain = chain_ids([diff(n) for n in range(200)])
    value = layers_above_label(chain, 0)
    assert len(LABEL_LAYERS_ABOVE) + len(value) <= MAX_LABEL_BYTES
    named = value.split(",")
    assert named == chain[1 : 1 + len(named)] and 40 <= len(named) <= MAX_LAYERS_ABOVE


def test_a_label_is_read_as_well_formed_chain_ids_only_each_once_and_bounded() -> None:
    good = chain_ids([diff(n) for n in range(3)])
    hostile = ",".join([good[1], "../../etc", good[1], "sha256:" + "G" * 64, " " + good[2] + " ", "x" * 10_000])
    assert layers_above({LABEL_LAYERS_ABOVE: hostile}) == [good[1], good[2]]
    assert layers_above({}) == []
    many = ",".join(chain_ids([diff(n) for n in range(500)]))
    assert len(layers_above({LABEL_LAYERS_ABOVE: many})) == MAX_LAYERS_ABOVE
