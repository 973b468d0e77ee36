"""Issue 36's yardstick of the layer server's CPU (``bench/hot_set_cost.py``): the frames of a published hot list,
read from a store the real converter wrote, decompressed and hashed on one thread, counted right; a frame that is
not its block, or not in the store, is an error naming the block, never counted; and what the lazy-layers report
makes of it (the hot-list section's rows and issue 36's target line, met and missed)."""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path

import pytest
import zstandard

from bench import hot_set_cost
from bench.hot_set_cost import HotSetCost, HotSetError, measure, measure_published
from bench.image_build import Image, LayerBlob
from bench.lazy_report import report
from bench.lazy_scenarios import PER_DATA_PATH, SCENARIOS, Run, Scenario, named
from bootseer.blockstore.objects.format import pack_object
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.hotlist.format import HotBlock, HotList, hotlist_object
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer

MB = 1_000_000
BLOCK_SIZE = 64 << 10
#: The files of the two layers (random bytes: no block is all zeros, none is stored twice).
SIZES = {"bin/tool": 5 * BLOCK_SIZE, "lib/libbig.so": 12 * BLOCK_SIZE + 7, "app/main.py": 3 * BLOCK_SIZE + 100,
         "app/data.bin": 2 * BLOCK_SIZE}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer], HotList]:
    """A store the converter wrote, holding the default hot list of its image: every block of both layers."""
    rng = random.Random(36)
    files = {path: File(path, rng.randbytes(size)) for path, size in SIZES.items()}
    layers = [Layer((files["bin/tool"], files["lib/libbig.so"])), Layer((files["app/main.py"], files["app/data.bin"]))]
    store = tmp_path_factory.mktemp("store")
    built = build_store(store, layers, block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    chain = [layer.chain_id for layer in built]
    blocks = [HotBlock(layer.chain_id, block.digest, layer.index.packs[block.pack], block.offset, block.clen,
                       block.rlen, 0.0)
              for layer in built for block in layer.index.blocks if not block.is_zero]
    hot = HotList(chain[-1], "", chain, blocks)
    FileStoreWriter(store).put(hotlist_object(chain[-1]), hot.encode())
    return store, built, hot


def test_every_frame_of_the_published_list_is_counted_once_per_pass(converted):
    store, built, hot = converted
    cost = measure_published(store, built[-1].chain_id, repeats=2)
    assert cost.blocks == len(hot.blocks) == sum(-(-size // BLOCK_SIZE) for size in SIZES.values())
    assert cost.raw_bytes == sum(SIZES.values())  # every file byte, decompressed
    assert cost.stored_bytes == hot.total_bytes
    assert 0 < cost.cpu_seconds and 0 < cost.wall_seconds


def test_the_command_finds_the_one_image_with_a_list_and_prints_its_figures(converted, capsys):
    store, _, hot = converted
    assert hot_set_cost.main(["--store", str(store), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"hot list of {hot.image}" in out and f"{len(hot.blocks)} blocks" in out and "s CPU" in out


def test_a_store_without_the_list_is_an_error(converted, tmp_path):
    store, built, _ = converted
    with pytest.raises(HotSetError, match="holds no hot list of image"):
        measure_published(store, built[0].chain_id)  # the bottom layer is an image of its own, with no list


def _frames_store(tmp_path: Path, blocks: list[bytes]) -> tuple[Path, HotList, Path]:
    """A store directory of one hand-made pack of ``blocks``' zstd frames, and a hot list of them all."""
    compressor = zstandard.ZstdCompressor(level=3)
    frames = [compressor.compress(block) for block in blocks]
    pack = b"".join(frames)
    name = hashlib.sha256(pack).hexdigest()
    writer = FileStoreWriter(tmp_path / "store")
    writer.put(pack_object(name), pack)
    image = "sha256:" + "ab" * 32
    offsets = [sum(map(len, frames[:number])) for number in range(len(frames))]
    hot = HotList(image, "", [image], [HotBlock(image, hashlib.sha256(block).hexdigest(), name, offset, len(frame),
                                                len(block), 0.0)
                                       for block, frame, offset in zip(blocks, frames, offsets)])
    return writer.root, hot, writer.path(pack_object(name))


def test_frames_made_with_zstandard_are_counted(tmp_path):
    blocks = [bytes([n]) * 40_000 + random.Random(n).randbytes(3000) for n in range(5)]
    store, hot, _ = _frames_store(tmp_path, blocks)
    cost = measure(store, hot, repeats=1)
    assert (cost.blocks, cost.raw_bytes, cost.stored_bytes) == (5, 5 * 43_000, hot.total_bytes)
    assert cost.stored_bytes < cost.raw_bytes / 4  # mostly runs of one byte: compressed well


def test_a_frame_that_is_not_its_blocks_bytes_is_an_error_naming_the_block(tmp_path):
    blocks = [random.Random(n).randbytes(30_000) for n in range(4)]
    store, hot, pack = _frames_store(tmp_path, blocks)
    bad = hot.blocks[2]
    data = bytearray(pack.read_bytes())
    data[bad.offset + bad.clen // 2] ^= 0xFF  # a byte of the third frame's content: still a frame, other bytes
    pack.write_bytes(bytes(data))
    with pytest.raises(HotSetError, match=f"hot list block 2 \\(sha256:{bad.digest} .*does not decompress"):
        measure(store, hot, repeats=1)


def test_a_list_naming_the_wrong_digest_is_an_error_not_a_count(tmp_path):
    blocks = [random.Random(n).randbytes(30_000) for n in range(3)]
    store, hot, _ = _frames_store(tmp_path, blocks)
    first = hot.blocks[0]
    wrong = HotBlock(first.layer, hot.blocks[1].digest, first.pack, first.offset, first.clen, first.rlen, 0.0)
    with pytest.raises(HotSetError, match=f"hot list block 0 \\(sha256:{wrong.digest} "):
        measure(store, HotList(hot.image, "", hot.layers, [wrong, *hot.blocks[1:]]), repeats=1)


def test_a_frame_past_the_end_of_its_pack_or_in_no_pack_is_an_error_naming_the_block(tmp_path):
    store, hot, pack = _frames_store(tmp_path, [random.Random(n).randbytes(20_000) for n in range(3)])
    last = hot.blocks[-1]
    pack.write_bytes(pack.read_bytes()[:-10])
    with pytest.raises(HotSetError, match=f"hot list block 2 \\(sha256:{last.digest} .*the pack ends after"):
        measure(store, hot)
    pack.unlink()
    with pytest.raises(HotSetError, match="hot list block 0 .*no such pack"):
        measure(store, hot)


# --------------------------------------------------------------------------- the report


class FakeInstall:
    """What the report asks of the containerd it names."""

    def describe(self) -> str:
        return "containerd (fake)"


def _report(server_cpu: list[float], cost: HotSetCost | None, paths: tuple[str, ...] = ("fanotify",),
            errors: tuple[str, ...] = ()) -> str:
    scenarios = {named(base, path): Scenario(named(base, path))
                 for base in SCENARIOS for path in (paths if base in PER_DATA_PATH else [None])}

    def run(seconds: float, **server: float) -> Run:
        return Run(seconds=seconds, pull_seconds=1.0, link_bytes=100 * MB, output="BOOTSEER-FIRST-OUTPUT",
                   server=dict(server))

    scenarios["overlay-cold"].runs.append(run(15.0))
    scenarios["overlay-warm"].runs.append(run(3.0))
    hot_cold = scenarios[named("hot-cold", paths[0])]
    hot_cold.runs.extend(run(5.5, **{"server.cpu_seconds": cpu}) for cpu in server_cpu)
    hot_cold.errors.extend(errors)
    image = Image(layout=Path("/nonexistent"), tag="t", manifest_digest="sha256:0",
                  layers=(LayerBlob("base", "sha256:1", 100 * MB, "sha256:2", 300 * MB, "base"),))
    hot = {"data_path": paths[0], "boot_seconds": 10.0, "blocks": 1620, "bytes": 86 * MB, "raw_bytes": 276 * MB,
           "span_s": 7.2, "sealed_by": "marker", "outcome": "published", "hot_set_cost": cost}
    args = argparse.Namespace(rate="1gbit", reps=len(server_cpu), background_fill="on", fill_group=None)
    context = {"containerds": [FakeInstall()], "wall": 60.0, "load": (1.0, 1.0), "data_paths": list(paths),
               "data_path_flag": {"snapshotter": True}, "notes": [], "link_rate": 119.0,
               "hots": {paths[0]: hot}}
    return report(args, image, scenarios, context)


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


COST = HotSetCost(blocks=1620, stored_bytes=86 * MB, raw_bytes=276 * MB, cpu_seconds=1.5, wall_seconds=1.52)
TARGET = "| [fanotify] layer-server CPU of a hot-list start (hot-cold, median) / decompress + SHA-256 of its hot set"


def test_the_hot_list_section_shows_the_hot_sets_cost_and_the_servers_cpu_against_it():
    text = _report([2.8, 2.9, 3.1], COST)
    assert _line(text, "| decompress + SHA-256 of the hot set's frames, one core (CPU s) |").endswith("| 1.500 |")
    assert _line(text, "| layer-server CPU of hot-cold, median").endswith("| 2.90 |")
    ratio = _line(text, "| layer-server CPU of hot-cold (median) / that")
    assert ratio.endswith("| 1.93× |") and "includes its own start-up and the pull" in ratio
    assert "the 1620 blocks of the list, 86.0 MB stored, 276.0 MB raw" in text
    assert _line(text, "| layer-server CPU over the start (s; its start-up and the pull included) |") == \
        "| layer-server CPU over the start (s; its start-up and the pull included) | 2.80 | 2.90 | 3.10 |"


def test_issue_36s_hot_set_target_is_met_within_twice_the_cost_and_missed_beyond():
    assert "## Targets of issue 36" in _report([2.9], COST)
    met = _line(_report([2.9], COST), TARGET)
    assert met.endswith("| ≤ 2× | 1.93× (2.90 s / 1.500 s) | met |")
    missed = _line(_report([3.1, 3.3], COST), TARGET)
    assert missed.endswith("| ≤ 2× | 2.13× (3.20 s / 1.500 s) | MISSED |")


def test_the_target_is_not_measured_without_the_cost_or_without_a_run():
    no_cost = _report([2.9], None)
    assert _line(no_cost, TARGET).endswith("| — | not measured (the hot set's decode: see Notes) |")
    assert _line(no_cost, "| decompress + SHA-256 of the hot set's frames, one core (CPU s) |").endswith("| — |")
    failed = _line(_report([], COST, errors=("run 1: node did not start",)), TARGET)
    assert failed.endswith("| — | not measured (see Failures) |")


def test_a_data_path_without_hot_cold_gets_no_hot_set_line():
    text = _report([], COST, paths=("erofs",))
    assert "layer-server CPU of a hot-list start" not in text and "Targets of issue 36" not in text
